"""Whole-state checkpoints: the state of a sequence after its first ``k`` chunks, for memories that cannot be cut.

A sliding-window cache holds only the window, and a recurrent memory one fixed block per
sequence, so their state cannot be cut into per-chunk cells (`worker.kvchunks`). What
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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np

from store import metrics
from store.blob import BlobName, encode_blob, verify_blob
from store.chain import Namespace
from store.errors import BlobCorrupt, BlobMismatch, BlobMissing, StoreUnavailable
from store.store import Store

log = logging.getLogger("kvpool.store")


class Checkpoints:
    """Checkpoint blobs of one store (composition: the store's backend, index and guards)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def deepest(self, keys: Sequence[bytes]) -> int:
        """How many leading chunks the deepest indexed checkpoint on chain ``keys`` covers (0: none), in one round trip."""
        if not keys:
            return 0
        present = self.store._guard("redis", lambda: self.store.index.present(keys))
        hits = [i for i, there in enumerate(present) if there]
        metrics.LOOKUPS.inc()
        return hits[-1] + 1 if hits else 0

    def fetch(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, keys: Sequence[bytes], depth: int) -> memoryview | None:
        """The verified payload of the checkpoint after ``depth`` chunks, or None (missing, bad or unreachable).

        A missing blob is dropped from the index, a bad one quarantined; neither raises.
        """
        i, c = depth - 1, ns.chunk_size
        name = str(BlobName(ns.key, i, keys[i]))
        try:
            data = self.store._timed_get(name)
        except BlobMissing:
            self.store._drop_quietly([keys[i]])
            log.warning("checkpoint.missing", extra={"chunk": keys[i].hex(), "index": i})
            return None
        except StoreUnavailable as e:
            metrics.UNAVAILABLE.labels("backend").inc()
            log.warning("fetch.unavailable", extra={"endpoint": e.endpoint, "reason": e.reason, "index": i})
            return None
        try:
            payload = verify_blob(
                data, namespace=ns.key, index=i, parent=ns.parent_of(keys, i), key=keys[i], tokens=tokens[i * c : depth * c]
            )
        except (BlobCorrupt, BlobMismatch) as e:
            metrics.CORRUPT.labels("corrupt" if isinstance(e, BlobCorrupt) else "mismatch").inc()
            log.error("checkpoint.rejected", extra={"chunk": keys[i].hex(), "index": i, "reason": str(e)})
            self.store._quarantine(name, data, keys[i])
            return None
        metrics.BYTES_READ.inc(len(data))
        self.store._touch_quietly([], tail=keys[i])
        return payload

    def missing(self, keys: Sequence[bytes], depths: Sequence[int]) -> list[int]:
        """Which of ``depths`` (chunks covered) have no checkpoint indexed; all of them when the index is unreachable."""
        if not depths:
            return []
        try:
            present = self.store._guard("redis", lambda: self.store.index.present([keys[d - 1] for d in depths]))
        except StoreUnavailable:
            return list(depths)
        return [d for d, there in zip(depths, present) if not there]

    def publish(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, keys: Sequence[bytes], payloads: Mapping[int, bytes]) -> int:
        """Store checkpoints (chunks covered -> state) the index lacks; returns how many were new. Idempotent."""
        depths = self.missing(keys, sorted(payloads))
        c = ns.chunk_size

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
