"""The store: chunks of prompt state in a blob backend, found through the Redis index.

Readers call `find` (how far, to the token, does the store hold this prompt?) and then
`fetch_prefix` (the verified payloads of a run of chunks and of the tail that `find`
chose); `lookup` and `fetch` do the same for full chunks only. Writers call `publish`
for full chunks and `publish_tail` for a prompt's partial last chunk. Every blob is
checked against the exact chain position it is fetched for before its payload is
returned; a blob that fails is counted, dropped from the index, moved to
``quarantine/`` and treated as the end of the usable prefix. A blob that is missing is
dropped from the index with every entry hanging from it (`store.stale`); after an
outage, a bounded reconciliation checks the index against the backend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from store import metrics
from store.backends import BlobBackend, open_backend
from store.blob import BlobName, encode_blob, verify_blob
from store.budget import store_budget
from store.chain import Namespace, tail_key
from store.errors import BlobCorrupt, BlobMismatch, BlobMissing, StoreUnavailable
from store.index import RedisIndex
from store.index_writes import publish_writes, read_publish
from store.maintenance import QUARANTINE_PREFIX, Maintenance
from store.settings import StoreSettings
from store.stale import Lost, Reconciler
from store.tails import Hit, TailMatch, best_tail

log = logging.getLogger("kvpool.store")

T = TypeVar("T")

DESCRIBE_EVERY_S = 300.0
"""How often a publisher records again what a namespace is (`RedisIndex.describe`)."""


@dataclass(frozen=True)
class Fetched:
    chunks: list[memoryview]
    """Verified payloads of the longest good run of chunks asked for."""
    tail: memoryview | None = None
    """The verified payload of the tail asked for, when every chunk before it was good."""


class Store(Maintenance):
    def __init__(
        self,
        backend: BlobBackend,
        index: RedisIndex,
        *,
        io_threads: int = 8,
        max_bytes: int | None = None,
        tails_per_chunk: int = 8,
        reconcile_batch: int = 256,
    ) -> None:
        self.backend = backend
        self.index = index
        self.max_bytes = max_bytes
        self.tails_per_chunk = tails_per_chunk
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvpool-store")
        self.about: dict[str, str] = {}
        """What this process's blobs are, beyond their layout (a worker's kernels): recorded beside each namespace it publishes to."""
        self._described: dict[bytes, float] = {}
        self.lost = Lost(index, backend, self._pool)
        self.reconciler = Reconciler(self.lost, self._pool, batch=reconcile_batch)
        self._down: set[str] = set()
        self._down_lock = threading.Lock()

    @classmethod
    def open(cls, settings: StoreSettings) -> Store:
        """Open the backend and index that ``settings`` name. Raises `StoreUnavailable`."""
        index = RedisIndex.from_url(
            settings.redis_url, connect_timeout_s=settings.connect_timeout_s, read_timeout_s=settings.read_timeout_s
        )
        backend = open_backend(settings)
        budget = store_budget(settings.store_max_bytes, backend, index.total_bytes)
        log.info("store.budget", extra={"store": backend.endpoint, "max_bytes": budget.max_bytes, "source": budget.source})
        return cls(
            backend,
            index,
            io_threads=settings.io_threads,
            max_bytes=budget.max_bytes,
            tails_per_chunk=settings.tails_per_chunk,
            reconcile_batch=settings.reconcile_batch,
        )

    def close(self) -> None:
        self.reconciler.close()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ---------------------------------------------------------------

    def find(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, keys: Sequence[bytes]) -> Hit:
        """How far the store holds this prompt, to the token: its deepest stored chunk, then the best tail from there."""
        metrics.LOOKUPS.inc()
        found = self._guard("redis", lambda: self.index.lookup(ns.key, keys))
        c = ns.chunk_size
        hit = Hit(found.depth, c, best_tail(found.tails, tokens[found.depth * c :], c))
        metrics.CHUNKS.labels("hit").inc(hit.depth)
        metrics.CHUNKS.labels("miss").inc(len(keys) - hit.depth)
        metrics.TOKENS.labels("hit").inc(hit.tokens)
        metrics.TOKENS.labels("miss").inc(max(0, len(tokens) - hit.tokens))
        return hit

    def fetch_prefix(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, keys: Sequence[bytes], start: int, hit: Hit) -> Fetched:
        """`fetch` for chunks ``start..hit.depth-1``, with ``hit``'s tail fetched alongside and verified as strictly."""
        name = str(BlobName(ns.key, hit.depth, hit.tail.key, tail=not hit.tail.full)) if hit.tail else None
        pending = self._pool.submit(self._timed_get, name) if name else None
        try:
            chunks = self.fetch(ns, tokens, keys, start, hit.depth)
        except BaseException:
            if pending:
                pending.cancel()
            raise
        if pending is None or hit.tail is None or name is None or start + len(chunks) < hit.depth:
            return Fetched(chunks)
        return Fetched(chunks, self._verified_tail(ns, keys, hit.depth, hit.tail, name, pending.result))

    def _verified_tail(
        self, ns: Namespace, keys: Sequence[bytes], depth: int, tail: TailMatch, name: str, get: Callable[[], bytes]
    ) -> memoryview | None:
        try:
            data = get()
        except BlobMissing:
            dropped = self._drop_lost([tail.key])
            log.warning("tail.missing", extra={"chunk": tail.key.hex(), "index": depth, "dropped": dropped})
            return None
        except StoreUnavailable as e:
            metrics.UNAVAILABLE.labels("backend").inc()
            log.warning("fetch.unavailable", extra={"endpoint": e.endpoint, "reason": e.reason, "index": depth})
            return None
        try:
            payload = verify_blob(
                data, namespace=ns.key, index=depth, parent=ns.parent_of(keys, depth), key=tail.key, tokens=tail.tokens, tail=not tail.full
            )
        except (BlobCorrupt, BlobMismatch) as e:
            metrics.CORRUPT.labels("corrupt" if isinstance(e, BlobCorrupt) else "mismatch").inc()
            log.error("chunk.rejected", extra={"chunk": tail.key.hex(), "index": depth, "tail": True, "reason": str(e)})
            self._quarantine(name, data, tail.key)
            return None
        metrics.BYTES_READ.inc(len(data))
        if tail.full:  # a chunk keeps a chunk's place in the eviction order, above its children
            self._touch_quietly([*keys[:depth], tail.key])
        else:
            self._touch_quietly(keys[:depth], tail=tail.key)
        return payload

    def fetch(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, keys: Sequence[bytes], start: int, stop: int) -> list[memoryview]:
        """Verified payloads of chunks ``start..stop-1``, fetched in parallel.

        Returns the longest good run from ``start``: a chunk that is missing, corrupt,
        foreign or unreachable ends the run, so the caller evaluates from there on. A
        missing chunk is dropped from the index with every entry hanging from it (the
        backend lost it: `store.stale`); a bad one is quarantined. Never raises for a
        single bad chunk.
        """
        if not 0 <= start <= stop <= len(keys):
            raise ValueError(f"bad chunk range {start}..{stop} of {len(keys)}")
        c = ns.chunk_size
        names = [str(BlobName(ns.key, i, keys[i])) for i in range(start, stop)]
        futures = [self._pool.submit(self._timed_get, n) for n in names]
        good: list[memoryview] = []
        try:
            for offset, fut in enumerate(futures):
                i = start + offset
                try:
                    data = fut.result()
                except BlobMissing:
                    # The backend lost data (an S3 that came back empty): what hangs from this chunk is
                    # of no use without it, and dropping it all lets the next publish store them again.
                    dropped = self._drop_lost(keys[i:])
                    log.warning("chunk.missing", extra={"chunk": keys[i].hex(), "index": i, "dropped": dropped})
                    break
                except StoreUnavailable as e:
                    metrics.UNAVAILABLE.labels("backend").inc()
                    log.warning("fetch.unavailable", extra={"endpoint": e.endpoint, "reason": e.reason, "index": i})
                    break
                try:
                    payload = verify_blob(
                        data,
                        namespace=ns.key,
                        index=i,
                        parent=keys[i - 1] if i else ns.key,
                        key=keys[i],
                        tokens=tokens[i * c : (i + 1) * c],
                    )
                except (BlobCorrupt, BlobMismatch) as e:
                    reason = "corrupt" if isinstance(e, BlobCorrupt) else "mismatch"
                    metrics.CORRUPT.labels(reason).inc()
                    log.error("chunk.rejected", extra={"chunk": keys[i].hex(), "index": i, "reason": str(e)})
                    self._quarantine(names[offset], data, keys[i])
                    break
                metrics.BYTES_READ.inc(len(data))
                good.append(payload)
        finally:
            for fut in futures:
                fut.cancel()
        if good:
            self._touch_quietly(keys[: start + len(good)])
        return good

    # -- writing ---------------------------------------------------------------

    def publish(
        self,
        ns: Namespace,
        tokens: Sequence[int] | np.ndarray,
        keys: Sequence[bytes],
        payloads: Mapping[int, bytes],
        *,
        tail: bytes | None = None,
        absent: bool = False,
    ) -> int:
        """Store the chunks ``payloads`` (chunk index -> payload) of one chain, and ``tail``, the prompt's partial last chunk
        ``tokens[len(keys)*C:]``; returns how many entries were new.

        Idempotent and safe with concurrent publishers: an entry already indexed is skipped,
        equal keys mean equal bytes, and the index counts each entry once. Blobs are written
        before their index entries, and every index write of the call (entries, the last
        chunk offered as a candidate, a tail capped at ``tails_per_chunk`` per chunk, the
        touch) goes in one round trip. ``absent``: the caller has just found every one of them
        missing from the index (`worker.cache.publisher`), so that check is not made again.
        """
        c, wanted = ns.chunk_size, sorted(payloads)
        if wanted and (wanted[0] < 0 or wanted[-1] >= len(keys)):
            raise ValueError(f"chunk index out of range 0..{len(keys) - 1}")
        tail_at = self._tail_of(ns, tokens, keys) if tail is not None else None
        probe = [keys[i] for i in wanted] + ([tail_at[0]] if tail_at else [])
        if not probe:
            return 0
        present = [False] * len(probe) if absent else self._guard("redis", lambda: self.index.present(probe))
        todo = [i for i, there in zip(wanted, present) if not there]
        new_tail = tail_at if tail_at and not present[-1] else None

        def put(i: int) -> tuple[int, int]:
            blob = encode_blob(ns.key, i, keys[i - 1] if i else ns.key, tokens[i * c : (i + 1) * c], payloads[i])
            self._put(str(BlobName(ns.key, i, keys[i])), blob)
            return i, len(blob)

        written = [f.result() for f in [self._pool.submit(put, i) for i in todo]]
        tail_blob = None
        if new_tail is not None and tail is not None:
            tail_blob = encode_blob(ns.key, len(keys), ns.parent_of(keys, len(keys)), new_tail[1], tail, tail=True)
            self._put(str(BlobName(ns.key, len(keys), new_tail[0], tail=True)), tail_blob)
        if written or tail_blob is not None:
            self._describe(ns)
        touched = keys if tail_at else keys[: wanted[-1] + 1]
        new = (*new_tail, len(tail_blob)) if new_tail is not None and tail_blob is not None else None
        writes = publish_writes(self.index.writes(), ns, tokens, keys, written, new, self.tails_per_chunk)
        writes.touch(touched, tail=tail_at[0] if tail_at else None)
        added, pushed = read_publish(self._guard("redis", writes.send), written, keys, new)
        for at, old in pushed:
            self._delete_quietly(str(BlobName(ns.key, at, old, tail=True)))
        if self.max_bytes is not None and (written or tail_blob is not None):
            self.gc(self.max_bytes)
        elif written or tail_blob is not None:  # the bytes gauge follows a write, as it follows an eviction or a drop
            metrics.BYTES_STORED.set(self._guard("redis", self.index.total_bytes))
        return added

    def _tail_of(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, keys: Sequence[bytes]) -> tuple[bytes, np.ndarray]:
        depth, c = len(keys), ns.chunk_size
        rest = np.asarray(tokens[depth * c :])
        if not 0 < len(rest) < c:
            raise ValueError(f"a tail holds 1 to {c - 1} tokens, not {len(rest)}")
        return tail_key(ns.parent_of(keys, depth), rest), rest

    def publish_tail(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, keys: Sequence[bytes], payload: bytes) -> bool:
        """`publish` of the prompt's partial last chunk alone; returns whether it was new."""
        return self.publish(ns, tokens, keys, {}, tail=payload) > 0

    def pin(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, until: float, *, keys: Sequence[bytes] | None = None) -> None:
        """Keep the stored prefix ``tokens`` (chain ``keys``, hashed here if not given: its full chunks, and its tail if it
        ends inside a chunk) until ``until``.

        What is not stored yet is not pinned: publish first (`store.index.RedisIndex.pin`).
        """
        keys = ns.chain(tokens) if keys is None else keys
        end = len(keys) * ns.chunk_size
        tail = tail_key(ns.parent_of(keys, len(keys)), tokens[end:]) if end < len(tokens) else None
        self._guard("redis", lambda: self.index.pin(keys, until, tail=tail))

    # -- internals -------------------------------------------------------------

    def _describe(self, ns: Namespace) -> None:
        """Say what ``ns`` is in the index, once every `DESCRIBE_EVERY_S` (so a cleared index learns it again)."""
        now = time.monotonic()
        if now - self._described.get(ns.key, -DESCRIBE_EVERY_S) < DESCRIBE_EVERY_S:
            return
        self._described[ns.key] = now
        about = {"layout": ns.layout.canonical(), "chunk_size": str(ns.chunk_size), **self.about}
        try:
            self.index.describe(ns.key, about)
        except StoreUnavailable as e:
            log.warning("index.unavailable", extra={"endpoint": e.endpoint, "reason": e.reason})

    def _timed_get(self, name: str) -> bytes:
        t0 = time.perf_counter()
        try:
            data = self.backend.get(name)
        except BlobMissing:
            self._seen("backend", up=True)  # it answered
            raise
        except StoreUnavailable:
            self._seen("backend", up=False)
            raise
        self._seen("backend", up=True)
        metrics.REQUEST_SECONDS.labels("get").observe(time.perf_counter() - t0)
        return data

    def _put(self, name: str, blob: bytes) -> None:
        t0 = time.perf_counter()
        try:
            self.backend.put(name, blob)
        except StoreUnavailable:
            self._seen("backend", up=False)
            raise
        self._seen("backend", up=True)
        metrics.REQUEST_SECONDS.labels("put").observe(time.perf_counter() - t0)
        metrics.BYTES_WRITTEN.inc(len(blob))

    def _guard(self, component: str, fn: Callable[[], T]) -> T:
        try:
            out = fn()
        except StoreUnavailable:
            metrics.UNAVAILABLE.labels(component).inc()
            self._seen(component, up=False)
            raise
        self._seen(component, up=True)
        return out

    def _seen(self, component: str, *, up: bool) -> None:
        """Note whether ``component`` (``backend``, ``redis``) answered; when it answers again after an outage, reconcile."""
        with self._down_lock:
            back = up and component in self._down
            if up:
                self._down.discard(component)
            else:
                self._down.add(component)
        if back:
            log.info("store.back", extra={"component": component})
            self.reconciler.trigger()

    def _drop_lost(self, keys: Sequence[bytes]) -> int:
        try:
            return self.lost.drop(keys, found_by="fetch")
        except StoreUnavailable as e:
            log.warning("index.unavailable", extra={"endpoint": e.endpoint, "reason": e.reason})
            return 0

    def _drop_quietly(self, keys: Sequence[bytes]) -> None:
        try:
            self.index.remove(keys)
        except StoreUnavailable as e:
            log.warning("index.unavailable", extra={"endpoint": e.endpoint, "reason": e.reason})

    def _delete_quietly(self, name: str) -> None:
        try:
            self.backend.delete(name)
        except StoreUnavailable as e:
            log.warning("delete.failed", extra={"blob": name, "reason": e.reason})

    def _touch_quietly(self, keys: Sequence[bytes], *, tail: bytes | None = None) -> None:
        try:
            self.index.touch(keys, tail=tail)
        except StoreUnavailable as e:
            log.warning("index.unavailable", extra={"endpoint": e.endpoint, "reason": e.reason})

    def _quarantine(self, name: str, data: bytes, key: bytes) -> None:
        """Move a bad blob aside (kept for inspection) and forget it in the index."""
        self._drop_quietly([key])
        try:
            self.backend.put(QUARANTINE_PREFIX + name, data)
            self.backend.delete(name)
        except StoreUnavailable as e:
            log.warning("quarantine.failed", extra={"blob": name, "reason": e.reason})
