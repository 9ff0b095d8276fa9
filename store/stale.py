"""Index entries whose blob is gone: found by a fetch or by a bounded reconciliation after an outage, and dropped
with every entry that hangs from them.

The index is a cache of what the backend holds (`store.index`). An S3 that comes back
empty, or a Redis restored from an older snapshot, leaves entries whose blobs are gone:
their bytes count against the budget, so GC evicts live chunks early, and each lookup
that lands on one pays a failed fetch. Only a blob the backend reports missing
(``NoSuchKey``, file not found) is gone; an unreachable backend drops nothing.

What hangs from a gone chunk is of no use without it: the chunks deeper on its chains
and the tails hanging from them. `Lost.drop` drops them with it in one step (the index
links every chunk to its parent, see ``children:`` in `store.index`), deletes the
blobs of theirs that remain, so that the bytes indexed are the bytes stored, and counts
them in ``kvpool_store_stale_index_entries_total``. Entries written without that link (by
`Store.reindex`, or by a kvpool before it) drop alone; what hangs from them is found when
it is fetched or reconciled.

`Reconciler`: after an outage (the store saw `StoreUnavailable`, then an operation on
that component succeeds), a background round checks index entries against the backend,
at most ``batch`` per pass. When the first pass finds nothing gone the round ends there
(the backend came back as it was); otherwise passes go on until every entry has been
checked once. A pass's entries are a slice of a ZSCAN, so a random sample on a large
index: a backend that lost a noticeable share of its blobs shows it in the first pass.
One process at a time reconciles an index (redis-py's `Lock`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis

from store import metrics
from store.backends import BlobBackend
from store.blob import BlobName
from store.errors import StoreUnavailable
from store.index import IndexEntry, RedisIndex

log = logging.getLogger("kvpool.store")

# Drop entries and everything hanging from them -- the chunks linked under each (``children:``),
# the tails and candidates of each (``tails:``) -- breadth first, visiting at most ARGV[2] keys.
# Returns the dropped entries ({key, ns, index, tail 0/1}), the keys left to visit, and the bytes
# indexed afterwards. KEYS: lru, bytes; ARGV: key prefix, limit, root key hexes.
_DROP_TREE = """
local p, queue, head, out, freed = ARGV[1], {}, 1, {}, 0
for i = 3, #ARGV do queue[#queue + 1] = ARGV[i] end
while head <= #queue and head <= tonumber(ARGV[2]) do
  local k = queue[head]
  head = head + 1
  for _, c in ipairs(redis.call('SMEMBERS', p .. 'children:' .. k)) do queue[#queue + 1] = c end
  for _, c in ipairs(redis.call('HKEYS', p .. 'tails:' .. k)) do queue[#queue + 1] = c end
  redis.call('DEL', p .. 'children:' .. k, p .. 'tails:' .. k)
  local h = redis.call('HMGET', p .. 'chunk:' .. k, 'size', 'ns', 'index', 'parent', 'branch', 'up')
  if h[1] then
    freed = freed + tonumber(h[1])
    redis.call('DEL', p .. 'chunk:' .. k)
    out[#out + 1] = {k, h[2], h[3], h[4] and 1 or 0}
  end
  if h[4] or h[5] then redis.call('HDEL', p .. 'tails:' .. (h[4] or h[5]), k) end
  if h[6] then redis.call('SREM', p .. 'children:' .. h[6], k) end
  redis.call('ZREM', KEYS[1], k)
end
if freed > 0 then redis.call('DECRBY', KEYS[2], freed) end
local rest = {}
for i = head, #queue do rest[#rest + 1] = queue[i] end
return {out, rest, tonumber(redis.call('GET', KEYS[2]) or '0')}
"""


class Lost:
    """Drops the entries of blobs that are gone, with everything hanging from them."""

    def __init__(self, index: RedisIndex, backend: BlobBackend, pool: ThreadPoolExecutor, *, visits: int = 512) -> None:
        self.index = index
        self.backend = backend
        self._pool = pool
        self._visits = visits
        self._script = index.script(_DROP_TREE)

    def drop(self, roots: Sequence[bytes], *, found_by: str) -> int:
        """Drop ``roots`` (blobs found missing) and every entry hanging from them; returns the entries dropped.

        Their blobs that remain are deleted in the background. Raises `StoreUnavailable`
        when Redis cannot be reached.
        """
        if not roots:
            return 0
        names = self.tree(roots)
        metrics.STALE.inc(len(names))
        for name in names:
            self._pool.submit(self._delete_quietly, str(name))
        if names:
            log.warning("index.stale_dropped", extra={"entries": len(names), "found_by": found_by})
        return len(names)

    def tree(self, roots: Sequence[bytes]) -> list[BlobName]:
        """Drop the entries of ``roots`` and their descendants from the index; returns the blobs they named.

        Runs as bounded scripts, so that a large tree never holds Redis for long.
        """
        todo: list[str] = [k.hex() for k in roots]
        names: list[BlobName] = []
        while todo:
            out, rest, total = self._script([self.index.lru_key, self.index.bytes_key], [self.index.prefix, self._visits, *todo])
            names += [BlobName(bytes.fromhex(ns.decode()), int(i), bytes.fromhex(k.decode()), bool(t)) for k, ns, i, t in out]
            todo = [r.decode() for r in rest]
            metrics.BYTES_STORED.set(int(total))
        return names

    def _delete_quietly(self, name: str) -> None:
        try:
            self.backend.delete(name)
        except StoreUnavailable as e:
            log.warning("delete.failed", extra={"blob": name, "reason": e.reason})


@dataclass(frozen=True)
class Pass:
    checked: int
    gone: int
    """Entries whose blob the backend reported missing."""
    dropped: int
    """Entries dropped: those gone and what hung from them."""


@dataclass
class Round:
    passes: list[Pass] = field(default_factory=list)
    complete: bool = False
    """Every entry was checked once."""
    aborted: str | None = None
    """Why the round stopped early: the outage again, or another process reconciling."""


class _Scan:
    """A full pass over the index in steps, whatever comes and goes meanwhile (ZSCAN), handed out ``n`` entries at a time."""

    def __init__(self, index: RedisIndex) -> None:
        self.index = index
        self.cursor: int | None = None
        self.pending: deque[IndexEntry] = deque()

    @property
    def done(self) -> bool:
        return self.cursor == 0 and not self.pending

    def take(self, n: int) -> list[IndexEntry]:
        while len(self.pending) < n and self.cursor != 0:
            self.cursor, found = self.index.scan(self.cursor or 0, n)
            self.pending.extend(found)
        taken = [self.pending.popleft() for _ in range(min(n, len(self.pending)))]
        present = self.index.present([e.key for e in taken])  # skip what was dropped with an earlier gone entry
        return [e for e, there in zip(taken, present) if there]


class Reconciler:
    """Checks the index against the backend after an outage, in the background, ``batch`` entries per pass."""

    def __init__(self, lost: Lost, pool: ThreadPoolExecutor, *, batch: int, lock_s: float = 60.0) -> None:
        self.lost = lost
        self.index = lost.index
        self.backend = lost.backend
        self.batch = batch
        self.lock_s = lock_s
        self.last: Round | None = None
        """The last round that ran to its end (or was aborted)."""
        self._pool = pool
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._mutex = threading.Lock()

    def trigger(self) -> bool:
        """Start a round in the background, unless one is under way or reconciliation is off."""
        with self._mutex:
            if self.batch <= 0 or self._stop.is_set() or (self._thread is not None and self._thread.is_alive()):
                return False
            self._thread = threading.Thread(target=self._run, name="kvpool-reconcile", daemon=True)
            self._thread.start()
            return True

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        with self._mutex:
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self.last = self.round()
        except Exception:
            log.exception("store.reconcile_failed")

    def round(self) -> Round:
        """Check entries, ``batch`` per pass: one pass when it finds nothing gone, else until every entry was checked once."""
        result = Round()
        lock = self.index.r.lock(self.index.prefix + "reconcile", timeout=self.lock_s, blocking=False)
        try:
            if not lock.acquire():
                result.aborted = "another process is reconciling"
                return result
            scan = _Scan(self.index)
            while not self._stop.is_set():
                result.passes.append(self._pass(scan))
                if scan.done or (len(result.passes) == 1 and result.passes[0].gone == 0):
                    result.complete = scan.done
                    break
                lock.reacquire()
        except (StoreUnavailable, redis.RedisError) as e:
            result.aborted = str(e)
        finally:
            _release_quietly(lock)
        p = result.passes
        log.info(
            "store.reconcile",
            extra={
                "passes": len(p),
                "checked": sum(x.checked for x in p),
                "gone": sum(x.gone for x in p),
                "dropped": sum(x.dropped for x in p),
                "complete": result.complete,
                "aborted": result.aborted or "",
            },
        )
        return result

    def _pass(self, scan: _Scan) -> Pass:
        """Check the next ``batch`` entries of ``scan``; drop those whose blob is gone. Raises `StoreUnavailable`."""
        entries = scan.take(self.batch)
        names = [str(BlobName(e.namespace, e.index, e.key, e.tail)) for e in entries]
        there = list(self._pool.map(self.backend.exists, names))
        gone = [e.key for e, ok in zip(entries, there) if not ok]
        metrics.RECONCILED.inc(len(entries))
        return Pass(len(entries), len(gone), self.lost.drop(gone, found_by="reconcile"))


def _release_quietly(lock: redis.lock.Lock) -> None:
    try:
        if lock.owned():
            lock.release()
    except redis.RedisError:
        pass  # it expires by itself
