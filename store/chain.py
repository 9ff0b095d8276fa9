"""Chain hashing: the content address of every chunk of prompt state.

A prompt's token ids are cut into fixed-size chunks. Chunk ``i`` is addressed by

    key[-1] = namespace key
    key[i]  = xxh3_128(key[i-1] || tokens[i*C:(i+1)*C] as little-endian int32)

so a key covers *every* token from position 0 to the end of its chunk. That is the
property everything else relies on: llama.cpp loads any well-formed KV state without
complaint, and a chunk restored after the wrong prefix silently decodes garbage. Two
prompts share chunk ``i`` only if they share all tokens up to the end of chunk ``i``.

The namespace key folds in everything else that changes the bytes of a chunk or who
may read it: the format version, the model fingerprint (a digest of the GGUF file),
the KV layout (cache types, flash attention, any llama.cpp setting that alters
the cache bytes, such as environment switches, and the fingerprint of the kernels that
compute the cells: `worker.kernels`), the chunk size and the tenant salt.
Changing any of them gives disjoint chains, never a wrong hit.

A prompt's last, partial chunk (its *tail*, 1 to C-1 tokens) gets a key of its own,

    tail_key = xxh3_128(b"kvpool/tail" || key[n-1] || tail tokens)

with a domain prefix that no full chunk key has, so a tail is never mistaken for a
chunk. A tail is a leaf: it is never anybody's parent. Because a cell depends only on
the tokens before it, the first ``j`` cells of a stored tail serve any prompt whose
tokens after ``key[n-1]`` start with the same ``j`` tokens; that is how a worker
resumes at the exact token another worker reached (`store.tails`).

Two chains are hashed from the same tokens. The *prefix* chain (`prefix_namespace`) has
no KV layout in its namespace: the gateway computes it, routes by it and puts it in the
job, so one gateway serves workers of any layout. The *blob* chain is rooted in a
namespace with the worker's KV layout: the worker derives it from the job's tokens and
stores, fetches and leases by it, so workers of each layout find only their own blobs
and a blob's verification is unchanged.

Both are `NewType`s of ``bytes`` (`PrefixKey`, `BlobKey`), so that one is never passed
where the other is meant, and a job hashes each chain once: the worker checks the job's
prefix keys, hashes the blob chain, and passes it along to the lookup, the restore, the
leases and the publisher; a longer prompt (prompt plus answer) extends it
(`extend_chain`) rather than hashing it again from the start.

Everything here is deterministic across processes and machines: xxh3 with seed 0,
explicit little-endian encodings, no Python ``hash()``, no pickle.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NewType, cast

import numpy as np
import xxhash

FORMAT_VERSION = 1
DEFAULT_CHUNK_SIZE = 256
KEY_BYTES = 16
MAX_TOKEN_ID = 2**31 - 1

PrefixKey = NewType("PrefixKey", bytes)
"""A key of the prefix chain (no KV layout): what the gateway routes by, jobs carry and adverts list."""
BlobKey = NewType("BlobKey", bytes)
"""A key of a blob chain (rooted in a worker's KV layout): what blobs, index entries and leases are named by."""

_NS_MAGIC = b"kvpool/namespace"
_TAIL_MAGIC = b"kvpool/tail"


CHECKPOINT_EXTRA = ("state", "checkpoint")
"""The layout extra of namespaces whose blobs are whole-state checkpoints (`store.checkpoints`), not cells."""
CHECKPOINT_LAYOUT = "=".join(CHECKPOINT_EXTRA)
"""How `CacheFormat.canonical` writes it."""


@dataclass(frozen=True)
class CacheFormat:
    """Every setting that changes the bytes of a KV cache for one model.

    ``extras`` holds llama.cpp settings outside the context parameters that still alter
    the cache (for example an environment variable such as ``LLAMA_ATTN_ROT_DISABLE``),
    plus the version of the code that writes chunk payloads.
    """

    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    extras: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, type_k: str, type_v: str, flash_attn: bool, extras: Mapping[str, str] | None = None) -> CacheFormat:
        return cls(type_k, type_v, bool(flash_attn), tuple(sorted((extras or {}).items())))

    def canonical(self) -> str:
        parts = [f"type_k={self.type_k}", f"type_v={self.type_v}", f"flash_attn={int(self.flash_attn)}"]
        parts += [f"{k}={v}" for k, v in sorted(self.extras)]
        return ";".join(parts)


@dataclass(frozen=True)
class Namespace:
    """What a chain is rooted in. Its ``key`` is the parent of chunk 0."""

    model_fingerprint: str
    layout: CacheFormat = field(default_factory=CacheFormat)
    chunk_size: int = DEFAULT_CHUNK_SIZE
    tenant_salt: str = ""

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")

    @cached_property
    def key(self) -> bytes:
        return namespace_key(self.model_fingerprint, self.layout, self.chunk_size, self.tenant_salt)

    def chain(self, tokens: Sequence[int] | np.ndarray) -> list[BlobKey]:
        """The keys of every full chunk of ``tokens`` (hash it once per prompt, then pass it along)."""
        return cast(list[BlobKey], chain_keys(self.key, tokens, self.chunk_size))

    def extend(self, keys: Sequence[BlobKey], tokens: Sequence[int] | np.ndarray) -> list[BlobKey]:
        """The chain of ``tokens`` given ``keys``, the chain of a prefix of them: only the chunks past it are hashed."""
        return cast(list[BlobKey], extend_chain(self.key, keys, tokens, self.chunk_size))

    def parent_of(self, keys: Sequence[bytes], index: int) -> bytes:
        """The key chunk (or tail) ``index`` hangs from: chunk ``index-1``, or the namespace for 0."""
        return keys[index - 1] if index else self.key


PREFIX_LAYOUT = CacheFormat("-", "-", False, (("address", "prefix"),))
"""The layout of the prefix chain: the same for every worker, so it names tokens, not bytes."""


def prefix_namespace(model_fingerprint: str, chunk_size: int, tenant_salt: str = "") -> Namespace:
    """The namespace of the prefix chain: model, chunk size and tenant, with no KV layout."""
    return Namespace(model_fingerprint, PREFIX_LAYOUT, chunk_size, tenant_salt)


def prefix_chain(model_fingerprint: str, chunk_size: int, tenant_salt: str, tokens: Sequence[int] | np.ndarray) -> list[PrefixKey]:
    """The prefix keys of every full chunk of ``tokens``."""
    return cast(list[PrefixKey], chain_keys(prefix_namespace(model_fingerprint, chunk_size, tenant_salt).key, tokens, chunk_size))


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def namespace_key(model_fingerprint: str, layout: CacheFormat | str, chunk_size: int, tenant_salt: str) -> bytes:
    """xxh3-128 over length-prefixed canonical fields, in a fixed order.

    ``layout`` may be given as its canonical string, as a worker advertises it: the
    gateway roots a worker's blob chain in it to see how deep the store holds a prompt
    for each layout in the pool (`gateway.dispatch`).
    """
    canonical = layout if isinstance(layout, str) else layout.canonical()
    payload = b"".join(
        [
            _NS_MAGIC,
            struct.pack("<I", FORMAT_VERSION),
            _field(model_fingerprint.encode()),
            _field(canonical.encode()),
            struct.pack("<I", chunk_size),
            _field(tenant_salt.encode()),
        ]
    )
    return xxhash.xxh3_128_digest(payload)


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as packed little-endian int32; rejects ids outside [0, 2**31)."""
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError("tokens must be a flat sequence of ints")
    if arr.size and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        raise ValueError("token ids must lie in [0, 2**31)")
    return arr.astype("<i4").tobytes()


def chunk_key(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """The key of one chunk given its parent's key (the namespace key for chunk 0)."""
    return xxhash.xxh3_128_digest(parent + token_bytes(tokens))


def chain_keys(namespace: bytes, tokens: Sequence[int] | np.ndarray, chunk_size: int) -> list[bytes]:
    """Keys of every full chunk of ``tokens``, in order."""
    raw = token_bytes(tokens)
    step = chunk_size * 4
    keys: list[bytes] = []
    parent = namespace
    for i in range(len(raw) // step):
        parent = xxhash.xxh3_128_digest(parent + raw[i * step : (i + 1) * step])
        keys.append(parent)
    return keys


def extend_chain(namespace: bytes, keys: Sequence[bytes], tokens: Sequence[int] | np.ndarray, chunk_size: int) -> list[bytes]:
    """`chain_keys` of ``tokens`` where ``keys`` already holds the keys of its first ``len(keys)`` chunks."""
    done = len(keys)
    if done * chunk_size > len(tokens):
        raise ValueError(f"{done} chunks of keys for {len(tokens)} tokens")
    parent = keys[-1] if done else namespace
    return [*keys, *chain_keys(parent, tokens[done * chunk_size :], chunk_size)]


def tail_key(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """The key of a partial last chunk hanging from ``parent`` (see the module docstring)."""
    return xxhash.xxh3_128_digest(_TAIL_MAGIC + parent + token_bytes(tokens))
