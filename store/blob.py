"""The blob format of one stored chunk, and the names blobs are stored under.

A blob is a self-describing header followed by the chunk's payload (opaque bytes to
the store; the worker's KV cells for the chunk). All integers are little-endian::

    magic           4   b"KVPC"
    version         u16 BLOB_VERSION
    flags           u16 bit 0: a tail (a prompt's partial last chunk); others reserved, 0
    namespace       16  namespace key of the chain
    index           u32 chunk index in the chain (0 = first chunk)
    parent          16  key of chunk index-1 (the namespace key for chunk 0)
    key             16  this chunk's key: `chunk_key` (or `tail_key`) of parent and tokens
    n_tokens        u32
    tokens          4 * n_tokens, int32
    payload_len     u64
    payload_digest  16  xxh3_128 of the payload
    header_digest   8   xxh3_64 of every header byte before it
    payload         payload_len bytes

`decode_blob` checks that the bytes are a well-formed, self-consistent blob
(`BlobCorrupt` otherwise); `verify_blob` also checks that it is the blob expected at
one position of one chain (`BlobMismatch` otherwise). Nothing hands a payload to a
model without going through `verify_blob`.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from store.chain import chunk_key, tail_key, token_bytes
from store.errors import BlobCorrupt, BlobMismatch

MAGIC = b"KVPC"
BLOB_VERSION = 1
FLAG_TAIL = 1

_HEAD = struct.Struct("<4sHH16sI16s16sI")
_TAIL = struct.Struct("<Q16s")
_DIGEST = struct.Struct("<Q")


@dataclass(frozen=True)
class ChunkHeader:
    namespace: bytes
    index: int
    parent: bytes
    key: bytes
    tokens: tuple[int, ...]
    payload_len: int
    payload_digest: bytes
    tail: bool = False

    @property
    def header_len(self) -> int:
        return header_size(len(self.tokens))


def header_size(n_tokens: int) -> int:
    return _HEAD.size + 4 * n_tokens + _TAIL.size + _DIGEST.size


def encode_blob(
    namespace: bytes, index: int, parent: bytes, tokens: Sequence[int] | np.ndarray, payload: bytes, *, tail: bool = False
) -> bytes:
    """Serialize one chunk (or tail). The key is computed here, from ``parent`` and ``tokens``."""
    toks = token_bytes(tokens)
    key = tail_key(parent, tokens) if tail else xxhash.xxh3_128_digest(parent + toks)
    head = (
        _HEAD.pack(MAGIC, BLOB_VERSION, FLAG_TAIL if tail else 0, namespace, index, parent, key, len(toks) // 4)
        + toks
        + _TAIL.pack(len(payload), xxhash.xxh3_128_digest(payload))
    )
    return b"".join([head, _DIGEST.pack(xxhash.xxh3_64_intdigest(head)), payload])


def decode_blob(data: bytes | memoryview) -> tuple[ChunkHeader, memoryview]:
    """Parse and integrity-check a blob; return its header and a view of its payload."""
    view = memoryview(data)
    if len(view) < _HEAD.size:
        raise BlobCorrupt(f"truncated: {len(view)} bytes is shorter than a header")
    magic, version, flags, ns, index, parent, key, n_tokens = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise BlobCorrupt(f"bad magic {bytes(magic)!r}")
    if version != BLOB_VERSION:
        raise BlobCorrupt(f"unsupported blob version {version} (this build reads {BLOB_VERSION})")
    hlen = header_size(n_tokens)
    if len(view) < hlen:
        raise BlobCorrupt(f"truncated header: {len(view)} of {hlen} bytes")
    (header_digest,) = _DIGEST.unpack_from(view, hlen - _DIGEST.size)
    if xxhash.xxh3_64_intdigest(view[: hlen - _DIGEST.size]) != header_digest:
        raise BlobCorrupt("header checksum mismatch")
    tok_end = _HEAD.size + 4 * n_tokens
    tokens = np.frombuffer(view[_HEAD.size : tok_end], dtype="<i4")
    payload_len, payload_digest = _TAIL.unpack_from(view, tok_end)
    if len(view) != hlen + payload_len:
        raise BlobCorrupt(f"payload length {len(view) - hlen} bytes, header says {payload_len}")
    payload = view[hlen:]
    if xxhash.xxh3_128_digest(payload) != payload_digest:
        raise BlobCorrupt("payload checksum mismatch")
    if flags & ~FLAG_TAIL:
        raise BlobCorrupt(f"unknown flags {flags:#x}")
    tail = bool(flags & FLAG_TAIL)
    if (tail_key if tail else chunk_key)(parent, tokens) != key:
        raise BlobCorrupt("key does not match parent and tokens")
    header = ChunkHeader(ns, index, parent, key, tuple(int(t) for t in tokens), payload_len, payload_digest, tail)
    return header, payload


def verify_blob(
    data: bytes | memoryview,
    *,
    namespace: bytes,
    index: int,
    parent: bytes,
    key: bytes,
    tokens: Sequence[int] | np.ndarray,
    tail: bool = False,
) -> memoryview:
    """Return the payload only if ``data`` is the intact blob for this exact chain position."""
    header, payload = decode_blob(data)
    if header.tail != tail:
        raise BlobMismatch(f"a {'tail' if header.tail else 'full chunk'} where a {'tail' if tail else 'full chunk'} was expected")
    if header.namespace != namespace:
        raise BlobMismatch(f"namespace {header.namespace.hex()} != expected {namespace.hex()}")
    if header.index != index:
        raise BlobMismatch(f"chunk index {header.index} != expected {index}")
    if header.parent != parent:
        raise BlobMismatch(f"parent {header.parent.hex()} != expected {parent.hex()}")
    if header.key != key:
        raise BlobMismatch(f"key {header.key.hex()} != expected {key.hex()}")
    if token_bytes(header.tokens) != token_bytes(tokens):
        raise BlobMismatch("chunk tokens differ from the expected tokens")
    return payload


_NAME = re.compile(r"^(chunks|tails)/v(\d+)/([0-9a-f]{32})/(\d{6})-([0-9a-f]{32})$")


@dataclass(frozen=True)
class BlobName:
    """Where a chunk lives in a backend: ``chunks/v1/<namespace>/<index>-<key>``; a tail under ``tails/``.

    The index is in the name so that the Redis index can be rebuilt from a plain
    listing, without reading any blob.
    """

    namespace: bytes
    index: int
    key: bytes
    tail: bool = False

    def __str__(self) -> str:
        kind = "tails" if self.tail else "chunks"
        return f"{kind}/v{BLOB_VERSION}/{self.namespace.hex()}/{self.index:06d}-{self.key.hex()}"

    @classmethod
    def parse(cls, name: str) -> BlobName | None:
        m = _NAME.match(name)
        if m is None or int(m.group(2)) != BLOB_VERSION:
            return None
        return cls(bytes.fromhex(m.group(3)), int(m.group(4)), bytes.fromhex(m.group(5)), m.group(1) == "tails")
