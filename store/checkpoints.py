"""Whole-state checkpoints: the state of a sequence after its first ``k`` tokens, for memories that cannot be cut.

A sliding-window cache holds only the window, and a recurrent memory one fixed block per
sequence, so their state cannot be cut into per-chunk cells (`worker.cache.kvchunks`). What
can be stored is the whole state at a chunk boundary. It is a function of the tokens up
to that boundary alone, so it is content-addressed by the chain key of the boundary's
chunk, exactly like a chunk, and it is stored and verified like one: a blob whose header
names its namespace, position, parent, key and the chunk's tokens (`store.blob`).

Differences from chunks, all of them here:

- Only the deepest checkpoint on a prompt's chain is fetched; the ones before it are not
  needed, so a chain may have holes and `deepest` looks at every key, not at a run.
- Checkpoints live in namespaces of their own (the worker's layout says ``state=checkpoint``),
  so a checkpoint is never joined with cells, nor cells restored as a checkpoint.
- Each is indexed as a leaf (`RedisIndex.add` with ``leaf``): nothing hangs from it, and it
  sorts like a tail under eviction, going before chunks used at the same time.

A prompt's end rarely falls on a boundary, so the state where its evaluation stopped (just
before its last two tokens) is stored too, as a *tail checkpoint*: keyed, stored, indexed
and capped per boundary like a cell tail (`store.tails`), but usable only whole, by a
prompt that continues with all of its tokens: a resent prompt, the next turn of a chat
(`find`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from store import metrics
from store.blob import BlobName, encode_blob, verify_blob
from store.chain import Namespace, tail_key, token_bytes
from store.errors import BlobCorrupt, BlobMismatch, BlobMissing, StoreUnavailable
from store.store import Store
from store.tails import TailMatch, common_prefix

log = logging.getLogger("kvpool.store")

Tokens = Sequence[int] | np.ndarray


@dataclass(frozen=True)
class Found:
    """The deepest checkpoint a prompt may resume from."""

    depth: int
    """Full chunks before it (all of it, for a boundary checkpoint)."""
    chunk_size: int
    tail: TailMatch | None = None
    """A tail checkpoint, whose tokens the prompt continues with after ``depth`` chunks."""

    @property
    def tokens(self) -> int:
        return self.depth * self.chunk_size + (len(self.tail.tokens) if self.tail else 0)


def checkpoint_key(ns: Namespace, tokens: Tokens, keys: Sequence[bytes], end: int) -> bytes:
    """The key of the checkpoint after ``end`` tokens: the boundary's chain key, or a tail key."""
    d, r = divmod(end, ns.chunk_size)
    return keys[d - 1] if r == 0 else tail_key(ns.parent_of(keys, d), tokens[d * ns.chunk_size : end])


def checkpoint_name(ns: Namespace, tokens: Tokens, keys: Sequence[bytes], end: int) -> BlobName:
    """Where the checkpoint after ``end`` tokens is stored."""
    d, r = divmod(end, ns.chunk_size)
    return BlobName(ns.key, d - 1 if r == 0 else d, checkpoint_key(ns, tokens, keys, end), tail=r != 0)


class Checkpoints:
    """Checkpoint blobs of one store (composition: the store's backend, index and guards)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # -- reading ---------------------------------------------------------------

    def deepest(self, keys: Sequence[bytes]) -> int:
        """How many leading chunks the deepest indexed boundary checkpoint on chain ``keys`` covers (0: none), in one round trip."""
        if not keys:
            return 0
        present = self.store._guard("redis", lambda: self.store.index.present(keys))
        hits = [i for i, there in enumerate(present) if there]
        metrics.LOOKUPS.inc()
        return hits[-1] + 1 if hits else 0

    def find(self, ns: Namespace, tokens: Tokens, keys: Sequence[bytes], limit: int) -> Found:
        """The deepest checkpoint holding at most ``limit`` leading tokens of the prompt, in two round trips.

        First the deepest boundary checkpoint, then the tail checkpoints hanging from it and
        from every boundary after it up to ``limit``: one that the prompt continues with
        whole and that ends deepest wins.
        """
        c = ns.chunk_size
        depth = self.deepest(keys[: limit // c])
        best = Found(depth, c)
        for d, tail in self._tails_from(ns, tokens, keys, depth, limit):
            if best.tokens < d * c + len(tail.tokens):
                best = Found(d, c, tail)
        return best

    def fetch_found(self, ns: Namespace, tokens: Tokens, keys: Sequence[bytes], found: Found) -> memoryview | None:
        """`fetch` for what `find` found: a boundary checkpoint or a tail checkpoint."""
        if found.tail is None:
            return self.fetch(ns, tokens, keys, found.depth)
        return self._get(ns, found.depth, found.tail.key, ns.parent_of(keys, found.depth), found.tail.tokens, tail=True)

    def fetch(self, ns: Namespace, tokens: Tokens, keys: Sequence[bytes], depth: int) -> memoryview | None:
        """The verified payload of the boundary checkpoint after ``depth`` chunks, or None (missing, bad or unreachable).

        A missing blob is dropped from the index, a bad one quarantined; neither raises.
        """
        i, c = depth - 1, ns.chunk_size
        return self._get(ns, i, keys[i], ns.parent_of(keys, i), tokens[i * c : depth * c])

    def _get(self, ns: Namespace, i: int, key: bytes, parent: bytes, tokens: Tokens, *, tail: bool = False) -> memoryview | None:
        name = str(BlobName(ns.key, i, key, tail=tail))
        try:
            data = self.store._timed_get(name)
        except BlobMissing:
            self.store._drop_quietly([key])
            log.warning("checkpoint.missing", extra={"chunk": key.hex(), "index": i, "tail": tail})
            return None
        except StoreUnavailable as e:
            metrics.UNAVAILABLE.labels("backend").inc()
            log.warning("fetch.unavailable", extra={"endpoint": e.endpoint, "reason": e.reason, "index": i})
            return None
        try:
            payload = verify_blob(data, namespace=ns.key, index=i, parent=parent, key=key, tokens=tokens, tail=tail)
        except (BlobCorrupt, BlobMismatch) as e:
            metrics.CORRUPT.labels("corrupt" if isinstance(e, BlobCorrupt) else "mismatch").inc()
            log.error("checkpoint.rejected", extra={"chunk": key.hex(), "index": i, "tail": tail, "reason": str(e)})
            self.store._quarantine(name, data, key)
            return None
        metrics.BYTES_READ.inc(len(data))
        self.store._touch_quietly([], tail=key)
        return payload

    def _tails_from(self, ns: Namespace, tokens: Tokens, keys: Sequence[bytes], depth: int, limit: int) -> list[tuple[int, TailMatch]]:
        """The tail checkpoints the prompt continues with whole that hang from the boundary after ``depth`` chunks or a later
        one and end at or before ``limit`` tokens (chunks before each, tail), in one round trip."""
        c = ns.chunk_size
        top = min(limit // c, len(keys))
        parents = [ns.parent_of(keys, d) for d in range(depth, top + 1)]
        tables = self.store._guard("redis", lambda: self.store.index.tails_of(parents))
        found = []
        for d, table in zip(range(depth, top + 1), tables):
            for key, toks in table.items():
                end = d * c + len(toks)
                if end <= limit and common_prefix(toks, tokens[d * c : end]) == len(toks):
                    found.append((d, TailMatch(key, toks, len(toks))))
        return found

    # -- writing ---------------------------------------------------------------

    def supersede(self, ns: Namespace, tokens: Tokens, keys: Sequence[bytes], resumed: int) -> int:
        """Drop the prompt's tail checkpoints that end before ``resumed`` tokens; returns how many. Never raises.

        Called once a job that resumed from ``resumed`` tokens has stored the checkpoints of its
        prompt's end: a chat resends its whole history, so each turn resumes from the newest
        checkpoint, and the older ones of the same conversation would only pile up (whole
        states, as large as their position). The one it resumed from stays, for another
        request that parts from the same history (a retry, a side request of an agent).
        Boundary checkpoints stay: they are few (`worker.cache.checkpoints.spaced`) and shared. Every
        boundary before ``resumed`` is looked at (one round trip), not only those after the
        deepest boundary checkpoint, so no older tail of the conversation is left behind.
        """
        try:
            old = self._tails_from(ns, tokens, keys, 0, resumed - 1)
        except StoreUnavailable:
            return 0
        if not old:
            return 0
        self.store._drop_quietly([t.key for _, t in old])
        for d, t in old:
            self.store._delete_quietly(str(BlobName(ns.key, d, t.key, tail=True)))
        log.info("checkpoint.superseded", extra={"tails": len(old), "resumed": resumed})
        return len(old)

    def missing(self, ns: Namespace, tokens: Tokens, keys: Sequence[bytes], ends: Sequence[int]) -> list[int]:
        """Which of ``ends`` (tokens held) have no checkpoint indexed, in one round trip; all of them when the index is unreachable."""
        if not ends:
            return []
        wanted = [checkpoint_key(ns, tokens, keys, e) for e in ends]
        try:
            present = self.store._guard("redis", lambda: self.store.index.present(wanted))
        except StoreUnavailable:
            return list(ends)
        return [e for e, there in zip(ends, present) if not there]

    def publish(self, ns: Namespace, tokens: Tokens, keys: Sequence[bytes], payloads: Mapping[int, bytes]) -> int:
        """Store boundary checkpoints (chunks covered -> state) the index lacks; returns how many were new. Idempotent."""
        c = ns.chunk_size
        depths = [e // c for e in self.missing(ns, tokens, keys, [d * c for d in sorted(payloads)])]

        def put(depth: int) -> tuple[int, int]:
            i = depth - 1
            blob = encode_blob(ns.key, i, ns.parent_of(keys, i), tokens[i * c : depth * c], payloads[depth])
            self.store._put(str(BlobName(ns.key, i, keys[i])), blob)
            return i, len(blob)

        written = [f.result() for f in [self.store._pool.submit(put, d) for d in depths]]
        if written:
            self.store._describe(ns)
        added = 0
        for i, size in written:
            added += self.store._guard("redis", lambda i=i, size=size: self.store.index.add(keys[i], ns.key, i, size, leaf=True))  # type: ignore[misc]
        if self.store.max_bytes is not None and written:
            self.store.gc(self.store.max_bytes)
        return added

    def publish_tail(self, ns: Namespace, tokens: Tokens, keys: Sequence[bytes], end: int, payload: bytes) -> bool:
        """Store the tail checkpoint after ``end`` tokens; returns whether it was new. Keeps `tails_per_chunk` per boundary."""
        c, d = ns.chunk_size, end // ns.chunk_size
        if end % c == 0:
            raise ValueError(f"a checkpoint after {end} tokens lies on a boundary: `publish` stores it")
        parent, rest = ns.parent_of(keys, d), tokens[d * c : end]
        key = tail_key(parent, rest)
        if self.store._guard("redis", lambda: self.store.index.present([key]))[0]:
            return False
        blob = encode_blob(ns.key, d, parent, rest, payload, tail=True)
        self.store._put(str(BlobName(ns.key, d, key, tail=True)), blob)
        self.store._describe(ns)
        size = len(blob)
        cap = self.store.tails_per_chunk
        pushed = self.store._guard("redis", lambda: self.store.index.add_tail(key, ns.key, d, parent, token_bytes(rest), size, cap=cap))
        for old in pushed or []:
            self.store._delete_quietly(str(BlobName(ns.key, d, old, tail=True)))
        if self.store.max_bytes is not None:
            self.store.gc(self.store.max_bytes)
        return pushed is not None
