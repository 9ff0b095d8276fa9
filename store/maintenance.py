"""Keeping the store within budget and consistent: eviction, rebuilding the index, checking every blob, statistics.

Mixed into `store.store.Store`, which supplies the backend, the index, the I/O pool and
the quiet helpers these need.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from store import metrics
from store.backends import BlobBackend
from store.blob import BlobName, decode_blob
from store.chain import CHECKPOINT_LAYOUT
from store.errors import BlobCorrupt, BlobMismatch, BlobMissing
from store.index import IndexEntry, RedisIndex

log = logging.getLogger("kvpool.store")

CHUNKS_PREFIX = "chunks/"
TAILS_PREFIX = "tails/"
QUARANTINE_PREFIX = "quarantine/"
T = TypeVar("T")


@dataclass(frozen=True)
class GcResult:
    evicted_chunks: int
    evicted_bytes: int
    total_bytes: int


@dataclass
class VerifyResult:
    checked: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


class Maintenance:
    backend: BlobBackend
    index: RedisIndex
    max_bytes: int | None
    _pool: ThreadPoolExecutor

    def _guard(self, component: str, fn: Callable[[], T]) -> T:
        raise NotImplementedError

    def _delete_quietly(self, name: str) -> None:
        raise NotImplementedError

    def _quarantine(self, name: str, data: bytes, key: bytes) -> None:
        raise NotImplementedError

    # -- maintenance -----------------------------------------------------------

    def gc(self, max_bytes: int, now: float | None = None) -> GcResult:
        """Evict least recently used chunks, deepest first, until at most ``max_bytes`` are stored.

        Pinned entries (`RedisIndex.pin`) are never evicted before their pin runs out, even
        when that leaves the store over budget: they sort after everything used before their
        pin runs out, so eviction stops at the first one.
        """
        evicted = freed = 0
        t = time.time() if now is None else now
        total = self._guard("redis", self.index.total_bytes)
        while total > max_bytes:
            entries = [e for e in (self.index.get(k) for k in self.index.coldest(64)) if e is not None]
            victims: list[IndexEntry] = []
            for e in entries:
                if total - sum(v.size for v in victims) <= max_bytes or e.pinned_until > t:
                    break
                victims.append(e)
            if not victims:
                if entries:
                    log.warning("store.gc_pinned", extra={"total_bytes": total, "max_bytes": max_bytes})
                break
            freed_now = self.index.remove([v.key for v in victims])
            names = [str(BlobName(v.namespace, v.index, v.key, v.tail)) for v in victims]
            for fut in [self._pool.submit(self.backend.delete, n) for n in names]:
                fut.result()
            evicted += len(victims)
            freed += freed_now
            metrics.EVICTIONS.inc(len(victims))
            metrics.EVICTED_BYTES.inc(freed_now)
            total = self.index.total_bytes()
        metrics.BYTES_STORED.set(total)
        if evicted:
            log.info("store.gc", extra={"evicted_chunks": evicted, "evicted_bytes": freed, "total_bytes": total})
        return GcResult(evicted, freed, total)

    def reindex(self) -> int:
        """Rebuild the index from the backend's listing; returns the number of chunks indexed.

        Access times are lost with the old index: every chunk gets the same time, so
        eviction afterwards takes the deepest chunks first and still leaves no holes.
        Tails are deleted, not indexed: their tokens are not in their names, and the next
        request that ends in one stores it again. Checkpoints (namespaces described as
        ``state=checkpoint``) are indexed as leaves again.
        """
        described = self.index.descriptions()  # what the namespaces are does not depend on what is indexed
        self.index.clear()
        for ns, about in described.items():
            self.index.describe(ns, about)
        now = time.time()
        n = 0
        for obj in self.backend.list(CHUNKS_PREFIX):
            name = BlobName.parse(obj.name)
            if name is None:
                continue
            leaf = CHECKPOINT_LAYOUT in described.get(name.namespace, {}).get("layout", "").split(";")  # `store.checkpoints`
            n += self.index.add(name.key, name.namespace, name.index, obj.size, now=now, leaf=leaf)
        for obj in self.backend.list(TAILS_PREFIX):
            self._delete_quietly(obj.name)
        metrics.BYTES_STORED.set(self.index.total_bytes())
        log.info("store.reindex", extra={"chunks": n})
        return n

    def verify(self, *, repair: bool = False) -> VerifyResult:
        """Read and check every indexed blob; with ``repair``, drop and quarantine the bad ones."""
        result = VerifyResult()
        for e in self.index.entries():
            name = str(BlobName(e.namespace, e.index, e.key, e.tail))
            result.checked += 1
            try:
                data = self.backend.get(name)
            except BlobMissing:
                result.missing.append(name)
                if repair:
                    self.index.remove([e.key])
                continue
            try:
                header, _ = decode_blob(data)
                if (header.namespace, header.index, header.key, header.tail) != (e.namespace, e.index, e.key, e.tail):
                    raise BlobMismatch("header does not match the name it is stored under")
            except (BlobCorrupt, BlobMismatch) as err:
                result.bad.append((name, str(err)))
                if repair:
                    self._quarantine(name, data, e.key)
        return result

    def stats(self) -> dict[str, object]:
        entries = list(self.index.entries())
        total = self.index.total_bytes()
        metrics.BYTES_STORED.set(total)
        return {
            "backend": self.backend.endpoint,
            "index": self.index.endpoint,
            "chunks": sum(not e.tail for e in entries),
            "tails": sum(e.tail for e in entries),
            "bytes": total,
            "namespaces": len({e.namespace for e in entries}),
            "bytes_by_kernels": bytes_by_kernels(entries, self.index.descriptions()),
            "deepest_chunk": max((e.index for e in entries), default=-1) + 1,
            "max_bytes": self.max_bytes,
            "oldest_access": min((e.accessed for e in entries), default=None),
            "newest_access": max((e.accessed for e in entries), default=None),
        }


UNKNOWN_KERNELS = "unknown"
"""The kernels of a namespace nobody described (chunks stored before kernels were recorded)."""


def bytes_by_kernels(entries: list[IndexEntry], described: dict[bytes, dict[str, str]]) -> dict[str, int]:
    """Stored bytes by the kernel fingerprint of the namespace they are in, largest first: the fleet's split."""
    out: dict[str, int] = {}
    for e in entries:
        kernels = _kernels_of(described.get(e.namespace, {}))
        out[kernels] = out.get(kernels, 0) + e.size
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def _kernels_of(about: dict[str, str]) -> str:
    """The kernels a namespace's publisher described, else the ``kernels`` field of its layout (a digest), else unknown."""
    if about.get("kernels"):
        return about["kernels"]
    fields = dict(part.partition("=")[::2] for part in about.get("layout", "").split(";"))
    return f"kernels={fields['kernels']}" if fields.get("kernels") else UNKNOWN_KERNELS
