"""The chunk index in Redis: which chunks exist, their sizes and recency, and the store's total bytes.

The index is a cache of the truth held by the blob backend. A blob is always written
before its index entry, an entry whose blob turns out to be gone is dropped by the
reader that finds it missing, and `Store.reindex` rebuilds everything from a listing.

Keys (all under a versioned prefix, default ``kvpool:v1:``):

* ``chunk:<key hex>``   -- hash: ``ns``, ``index``, ``size``, ``created``; a tail also has
                           ``parent`` (hex of the chunk it hangs from), a full chunk that is
                           also a candidate (`add_branch`) has ``branch`` (its parent's hex),
                           a pinned entry ``pinned`` (Unix time its pin runs out)
* ``tails:<parent hex>`` -- hash: candidate key hex -> its tokens (little-endian int32): the
                           tails hanging from the chunk, and the last full chunk of each
                           prompt published under it; at most ``tails_per_chunk`` of them,
                           so that one lookup picks the candidate that matches a prompt furthest
* ``lru``               -- sorted set of chunk and tail keys by eviction order (lowest goes
                           first); the last-access time is read back from the score
* ``bytes``             -- total bytes of indexed blobs

Eviction order. A chain's chunk ``i`` is only ever useful when chunks ``0..i-1`` are
present, so eviction must never remove a parent before its children. Every access
touches a whole prefix ``0..d`` at once with one timestamp, and the score is

    score = centiseconds since 2020 * 2**15 + (2**15 - 1 - depth)

so parents always score at least as high as their children (they were touched at least
as recently, and at equal times the shallower chunk wins), and popping the lowest
score takes the deepest chunk of the least recently used chain first. Tails score as
the deepest possible depth, so of everything touched at one time they go first, and
they are never a parent. Scores stay below 2**53 (until the year 2105), so Redis's
doubles hold them exactly.

A *pin* (`pin`, asked for by a prompt's ``cache_control`` breakpoint) marks a prefix's
entries with the time it runs out (``pinned`` in each hash), which eviction respects
(`store.maintenance`), and scores them as if touched at that time: they sort after
everything used before it, a prompt's capped tails keep them, and once the time passes
it is simply their last use. A pin covers a whole prefix with one time, so parents
still outlast their children.

`lookup` answers "how deep is this chain stored, and which tails hang from its deepest
stored chunk?" in one round trip, whatever the index holds: one ``ZSCORE`` per chunk of
the prompt and one ``HGETALL`` of at most ``tails_per_parent`` fields.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np
import redis

from store.errors import StoreUnavailable

_DEPTH_SLOTS = 2**15
TAIL_DEPTH = _DEPTH_SLOTS - 1
_EPOCH = 1_577_836_800
T = TypeVar("T")

# Insert an entry once: concurrent publishers of one chunk count its bytes once.
_ADD = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'ns', ARGV[1], 'index', ARGV[2], 'size', ARGV[3], 'created', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[6])
redis.call('INCRBY', KEYS[3], ARGV[3])
return 1
"""

# Remove entries (a tail, or a chunk that is also a branch candidate, from its parent's
# tails); returns the bytes freed. KEYS: lru, then chunk hashes; ARGV: bytes key, key prefix, key hexes.
_REMOVE = """
local freed = 0
for i = 2, #KEYS do
  local h = redis.call('HMGET', KEYS[i], 'size', 'parent', 'branch')
  if h[1] then
    freed = freed + tonumber(h[1])
    redis.call('DEL', KEYS[i])
  end
  local parent = h[2] or h[3]
  if parent then redis.call('HDEL', ARGV[2] .. 'tails:' .. parent, ARGV[i + 1]) end
  redis.call('ZREM', KEYS[1], ARGV[i + 1])
end
if freed > 0 then redis.call('DECRBY', ARGV[1], freed) end
return freed
"""

# Keep a parent's newest ``cap`` candidates (KEYS: tails hash, lru, bytes; the new one is kept):
# a pushed-out tail is forgotten (its hex is returned: its blob is the caller's to delete); a
# pushed-out full chunk stays a chunk and only stops being a candidate.
_CAP = """
local function cap_tails(tails, lru, bytes, keep, cap, prefix)
  local out = {}
  while redis.call('HLEN', tails) > cap do
    local names = redis.call('HKEYS', tails)
    local scores = redis.call('ZMSCORE', lru, unpack(names))
    local worst, worst_score = nil, nil
    for i, n in ipairs(names) do
      local sc = scores[i] and tonumber(scores[i]) or -1
      if n ~= keep and (worst_score == nil or sc < worst_score) then worst, worst_score = n, sc end
    end
    if worst == nil then break end
    redis.call('HDEL', tails, worst)
    local chunk = prefix .. 'chunk:' .. worst
    if redis.call('HEXISTS', chunk, 'branch') == 1 then
      redis.call('HDEL', chunk, 'branch')
    else
      local size = redis.call('HGET', chunk, 'size')
      if size then redis.call('DECRBY', bytes, size) end
      redis.call('DEL', chunk)
      redis.call('ZREM', lru, worst)
      out[#out + 1] = worst
    end
  end
  return out
end
"""

# Insert a tail once, then cap its parent's candidates; returns the tails pushed out, or
# false when the tail was already indexed. KEYS: chunk hash, lru, bytes, tails hash;
# ARGV: ns, index, size, created, score, key, parent, tokens, cap, key prefix.
_ADD_TAIL = (
    _CAP
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
redis.call('HSET', KEYS[1], 'ns', ARGV[1], 'index', ARGV[2], 'size', ARGV[3], 'created', ARGV[4], 'parent', ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[6])
redis.call('INCRBY', KEYS[3], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[6], ARGV[8])
return cap_tails(KEYS[4], KEYS[2], KEYS[3], ARGV[6], tonumber(ARGV[9]), ARGV[10])
"""
)

# Make an indexed full chunk a candidate of its parent too, like a tail (see `add_branch`);
# returns the tails pushed out. KEYS: chunk hash, lru, bytes, tails hash; ARGV: key, parent,
# tokens, cap, key prefix.
_ADD_BRANCH = (
    _CAP
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
redis.call('HSET', KEYS[1], 'branch', ARGV[2])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
return cap_tails(KEYS[4], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[4]), ARGV[5])
"""
)

# Pin indexed entries until a time (never shortening a pin): KEYS: lru, then chunk hashes;
# ARGV: the time, then each entry's key hex and score.
_PIN = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    if tonumber(redis.call('HGET', KEYS[i], 'pinned') or '0') < tonumber(ARGV[1]) then
      redis.call('HSET', KEYS[i], 'pinned', ARGV[1])
    end
    redis.call('ZADD', KEYS[1], 'XX', 'GT', ARGV[2 * i - 1], ARGV[2 * i - 2])
  end
end
return 0
"""

# How many leading chunks are indexed, and the tails of the deepest one (or of the
# namespace, at depth 0). KEYS: lru; ARGV: key prefix, namespace hex, chain key hexes.
_LOOKUP = """
local depth = 0
for i = 3, #ARGV do
  if not redis.call('ZSCORE', KEYS[1], ARGV[i]) then break end
  depth = depth + 1
end
return {depth, redis.call('HGETALL', ARGV[1] .. 'tails:' .. ARGV[2 + depth])}
"""


def lru_score(now: float, depth: int) -> int:
    return int((now - _EPOCH) * 100) * _DEPTH_SLOTS + (_DEPTH_SLOTS - 1 - min(depth, _DEPTH_SLOTS - 1))


def score_time(score: float) -> float:
    return (int(score) // _DEPTH_SLOTS) / 100 + _EPOCH


@dataclass(frozen=True)
class IndexEntry:
    key: bytes
    namespace: bytes
    index: int
    size: int
    created: float
    accessed: float
    parent: bytes | None = None
    """Set for a tail only: the chunk it hangs from."""
    pinned_until: float = 0.0
    """Unix time before which eviction leaves the entry alone (`RedisIndex.pin`); 0: never pinned."""

    @property
    def tail(self) -> bool:
        return self.parent is not None


@dataclass(frozen=True)
class Lookup:
    """What one round trip tells about a chain: its stored depth and the tails of its deepest stored chunk."""

    depth: int
    tails: dict[bytes, np.ndarray]
    """Tail key -> its tokens."""


class RedisIndex:
    def __init__(self, client: redis.Redis[bytes], prefix: str = "kvpool:v1:") -> None:
        self.r = client
        self.prefix = prefix
        self.lru_key = prefix + "lru"
        self.bytes_key = prefix + "bytes"
        kwargs = client.connection_pool.connection_kwargs
        self.endpoint = f"redis://{kwargs.get('host', kwargs.get('path', '?'))}:{kwargs.get('port', '')}/{kwargs.get('db', 0)}"
        self._add = client.register_script(_ADD)
        self._add_tail = client.register_script(_ADD_TAIL)
        self._add_branch = client.register_script(_ADD_BRANCH)
        self._remove = client.register_script(_REMOVE)
        self._lookup = client.register_script(_LOOKUP)
        self._pin = client.register_script(_PIN)

    @classmethod
    def from_url(cls, url: str, *, connect_timeout_s: float = 2.0, read_timeout_s: float = 10.0) -> RedisIndex:
        client = redis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=read_timeout_s,
            retry_on_timeout=False,
        )
        return cls(client)

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise StoreUnavailable(self.endpoint, f"{type(e).__name__}: {e}") from e

    def _chunk(self, key: bytes) -> str:
        return f"{self.prefix}chunk:{key.hex()}"

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is indexed, in one round trip."""
        if not keys:
            return []
        scores = self._call(lambda: self.r.zmscore(self.lru_key, [k.hex() for k in keys]))  # type: ignore[no-untyped-call]
        return [s is not None for s in scores]

    def deepest(self, keys: Sequence[bytes]) -> int:
        """Length of the longest run of indexed chunks from the start of ``keys``, in one round trip."""
        flags = self.present(keys)
        return flags.index(False) if False in flags else len(flags)

    def lookup(self, namespace: bytes, keys: Sequence[bytes]) -> Lookup:
        """The stored depth of chain ``keys`` and the tails hanging from its deepest stored chunk, in one round trip."""
        args = [self.prefix, namespace.hex(), *[k.hex() for k in keys]]
        depth, flat = self._call(lambda: self._lookup(keys=[self.lru_key], args=args))
        tails = {bytes.fromhex(flat[i].decode()): np.frombuffer(flat[i + 1], "<i4") for i in range(0, len(flat), 2)}
        return Lookup(int(depth), tails)

    def touch(self, keys: Sequence[bytes], now: float | None = None, *, tail: bytes | None = None) -> None:
        """Mark a chain prefix ``keys[0..]`` (and a tail hanging from it) as used now; entries that are gone stay gone."""
        if not keys and tail is None:
            return
        t = time.time() if now is None else now
        mapping: dict[str | bytes, float] = {k.hex(): lru_score(t, depth) for depth, k in enumerate(keys)}
        if tail is not None:
            mapping[tail.hex()] = lru_score(t, TAIL_DEPTH)

        self._call(lambda: self.r.zadd(self.lru_key, mapping, xx=True, gt=True))

    def pin(self, keys: Sequence[bytes], until: float, *, tail: bytes | None = None) -> None:
        """Keep a chain prefix ``keys[0..]`` (and a tail hanging from it) from eviction until ``until`` (Unix time).

        A pin only ever lengthens, and entries that are not indexed are not pinned.
        """
        entries = [(k, lru_score(until, depth)) for depth, k in enumerate(keys)] + ([(tail, lru_score(until, TAIL_DEPTH))] if tail else [])
        if not entries:
            return
        args: list[str | int] = [repr(until)]
        for k, score in entries:
            args += [k.hex(), score]
        self._call(lambda: self._pin(keys=[self.lru_key, *[self._chunk(k) for k, _ in entries]], args=args))

    def add(self, key: bytes, namespace: bytes, index: int, size: int, now: float | None = None) -> bool:
        """Index one stored blob; False when it was already indexed."""
        t = time.time() if now is None else now
        args = [namespace.hex(), index, size, repr(t), lru_score(t, index), key.hex()]
        return bool(self._call(lambda: self._add(keys=[self._chunk(key), self.lru_key, self.bytes_key], args=args)))

    def add_tail(
        self, key: bytes, namespace: bytes, index: int, parent: bytes, tokens: bytes, size: int, *, cap: int, now: float | None = None
    ) -> list[bytes] | None:
        """Index one stored tail (``tokens``: its little-endian int32 token ids), keeping ``cap`` per parent.

        Returns the keys of the older tails of the same parent that it pushed out (their
        blobs are the caller's to delete), or None when the tail was already indexed.
        """
        t = time.time() if now is None else now
        args = [namespace.hex(), index, size, repr(t), lru_score(t, TAIL_DEPTH), key.hex(), parent.hex(), tokens, cap, self.prefix]
        keys = [self._chunk(key), self.lru_key, self.bytes_key, f"{self.prefix}tails:{parent.hex()}"]
        out = self._call(lambda: self._add_tail(keys=keys, args=args))
        return None if out is None else [bytes.fromhex(k.decode()) for k in out]

    def add_branch(self, key: bytes, parent: bytes, tokens: bytes, *, cap: int) -> list[bytes]:
        """Offer an indexed full chunk as a candidate of its parent, like a tail (``tokens``: its token ids).

        A prompt that parts from it inside the chunk then resumes where they part: the
        chunk's first cells serve it, as a tail's would. Returns the tails this pushed out.
        """
        args = [key.hex(), parent.hex(), tokens, cap, self.prefix]
        keys = [self._chunk(key), self.lru_key, self.bytes_key, f"{self.prefix}tails:{parent.hex()}"]
        return [bytes.fromhex(k.decode()) for k in self._call(lambda: self._add_branch(keys=keys, args=args))]

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop entries; returns the bytes they accounted for."""
        if not keys:
            return 0
        args = [self.bytes_key, self.prefix, *[k.hex() for k in keys]]
        return int(self._call(lambda: self._remove(keys=[self.lru_key, *[self._chunk(k) for k in keys]], args=args)))

    def contains(self, key: bytes) -> bool:
        return self._call(lambda: self.r.zscore(self.lru_key, key.hex())) is not None

    def coldest(self, n: int) -> list[bytes]:
        """The ``n`` chunks that eviction takes first."""
        return [bytes.fromhex(m.decode()) for m in self._call(lambda: self.r.zrange(self.lru_key, 0, n - 1))]

    def get(self, key: bytes) -> IndexEntry | None:
        def fetch() -> list[Any]:
            return self.r.pipeline(transaction=False).hgetall(self._chunk(key)).zscore(self.lru_key, key.hex()).execute()

        h, score = self._call(fetch)
        return _entry(key, h, score) if h and score is not None else None

    def entries(self, batch: int = 500) -> Iterator[IndexEntry]:
        """Every entry, hottest first."""
        start = 0
        while True:
            members = self._call(partial(self.r.zrevrange, self.lru_key, start, start + batch - 1, withscores=True))
            if not members:
                return
            keys = [bytes.fromhex(m.decode()) for m, _ in members]

            def fetch(keys: list[bytes] = keys) -> list[Any]:
                pipe = self.r.pipeline(transaction=False)
                for k in keys:
                    pipe.hgetall(self._chunk(k))
                return pipe.execute()

            for k, (_, score), h in zip(keys, members, self._call(fetch)):
                if h:
                    yield _entry(k, h, score)
            start += batch

    def count(self) -> int:
        return int(self._call(lambda: self.r.zcard(self.lru_key)))

    def total_bytes(self) -> int:
        return int(self._call(lambda: self.r.get(self.bytes_key)) or 0)

    def clear(self) -> None:
        def run() -> None:
            for batch in _batched(self.r.scan_iter(match=self.prefix + "*", count=1000), 1000):
                self.r.delete(*batch)

        self._call(run)

    def ping(self) -> None:
        self._call(self.r.ping)


def _entry(key: bytes, h: dict[bytes, bytes], score: float) -> IndexEntry:
    return IndexEntry(
        key=key,
        namespace=bytes.fromhex(h[b"ns"].decode()),
        index=int(h[b"index"]),
        size=int(h[b"size"]),
        created=float(h[b"created"]),
        accessed=score_time(score),
        parent=bytes.fromhex(h[b"parent"].decode()) if b"parent" in h else None,
        pinned_until=float(h.get(b"pinned", 0)),
    )


def _batched(it: Iterator[Any], n: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch
