"""The chunk index in Redis: which chunks exist, their sizes and recency, and the store's total bytes.

The index is a cache of the truth held by the blob backend. A blob is always written
before its index entry, an entry whose blob turns out to be gone is dropped by the
reader that finds it missing, and `Store.reindex` rebuilds everything from a listing.

Keys (all under a versioned prefix, default ``kvpool:v1:``):

* ``chunk:<key hex>``   -- hash: ``ns``, ``index``, ``size``, ``created``; a tail also has
                           ``parent`` (hex of the chunk it hangs from), a full chunk that is
                           also a candidate (`add_branch`) has ``branch`` (its parent's hex), a
                           full chunk past the first has ``up`` (its parent's hex), a pinned entry ``pinned`` (Unix
                           time its pin runs out)
* ``children:<parent hex>`` -- set: the full chunks indexed under a chunk, so that the entries
                           hanging from a chunk whose blob is gone can be dropped with it (`drop_tree`)
* ``tails:<parent hex>`` -- hash: candidate key hex -> its tokens (little-endian int32): the
                           tails hanging from the chunk, and the last full chunk of each
                           prompt published under it; at most ``tails_per_chunk`` of them,
                           so that one lookup picks the candidate that matches a prompt furthest
* ``lru``               -- sorted set of chunk and tail keys by eviction order (lowest goes
                           first); the last-access time is read back from the score
* ``bytes``             -- total bytes of indexed blobs
* ``namespaces``        -- hash: namespace hex -> JSON saying what it is (its layout, the
                           kernels of the workers that publish to it); for people
                           (`kvpool store stats`), never read by a lookup

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

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np
import redis

from store import index_lua as lua
from store.errors import StoreUnavailable
from store.index_writes import TAIL_DEPTH, IndexScripts, IndexWrites, lru_score, score_time

__all__ = ["TAIL_DEPTH", "IndexEntry", "IndexWrites", "Lookup", "RedisIndex", "lru_score", "score_time"]

T = TypeVar("T")


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
        self.scripts = IndexScripts(client, prefix)
        self.r = client
        self.prefix = prefix
        self.lru_key = prefix + "lru"
        self.bytes_key = prefix + "bytes"
        self.namespaces_key = prefix + "namespaces"
        kwargs = client.connection_pool.connection_kwargs
        self.endpoint = f"redis://{kwargs.get('host', kwargs.get('path', '?'))}:{kwargs.get('port', '')}/{kwargs.get('db', 0)}"
        self._remove = client.register_script(lua.REMOVE)
        self._lookup = client.register_script(lua.LOOKUP)
        self._pin = client.register_script(lua.PIN)

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

    def writes(self, now: float | None = None) -> IndexWrites:
        """Writes to queue and send together in one round trip (`store.index_writes`)."""
        return IndexWrites(self.scripts, self._call, now)

    def _chunk(self, key: bytes) -> str:
        return f"{self.prefix}chunk:{key.hex()}"

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is indexed, in one round trip."""
        if not keys:
            return []
        scores = self._call(lambda: self.r.zmscore(self.lru_key, [k.hex() for k in keys]))
        return [s is not None for s in scores]

    def tails_of(self, parents: Sequence[bytes]) -> list[dict[bytes, np.ndarray]]:
        """The tails hanging from each of ``parents`` (tail key -> its tokens), in one round trip."""
        if not parents:
            return []

        def run() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for p in parents:
                pipe.hgetall(f"{self.prefix}tails:{p.hex()}")
            return pipe.execute()

        return [{bytes.fromhex(k.decode()): np.frombuffer(v, "<i4") for k, v in table.items()} for table in self._call(run)]

    def deepest(self, keys: Sequence[bytes]) -> int:
        """Length of the longest run of indexed chunks from the start of ``keys``, in one round trip."""
        flags = self.present(keys)
        return flags.index(False) if False in flags else len(flags)

    def deepest_many(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """`deepest` of several chains, in one round trip."""

        def run() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for keys in chains:
                if keys:
                    pipe.zmscore(self.lru_key, [k.hex() for k in keys])  # type: ignore[no-untyped-call]
            return pipe.execute()

        found = iter(self._call(run) if any(chains) else [])
        out = []
        for keys in chains:
            flags = [s is not None for s in next(found)] if keys else []
            out.append(flags.index(False) if False in flags else len(flags))
        return out

    def describe(self, namespace: bytes, about: Mapping[str, str]) -> None:
        """Record what a namespace is (its layout, its kernels): one field, rewritten in place."""
        doc = json.dumps(dict(about), sort_keys=True)
        self._call(lambda: self.r.hset(self.namespaces_key, namespace.hex(), doc))

    def descriptions(self) -> dict[bytes, dict[str, str]]:
        """Every namespace's description, by namespace key."""
        raw = self._call(lambda: self.r.hgetall(self.namespaces_key))
        return {bytes.fromhex(k.decode()): json.loads(v) for k, v in raw.items()}

    def lookup(self, namespace: bytes, keys: Sequence[bytes]) -> Lookup:
        """The stored depth of chain ``keys`` and the tails hanging from its deepest stored chunk, in one round trip."""
        args = [self.prefix, namespace.hex(), *[k.hex() for k in keys]]
        depth, flat = self._call(lambda: self._lookup(keys=[self.lru_key], args=args))
        tails = {bytes.fromhex(flat[i].decode()): np.frombuffer(flat[i + 1], "<i4") for i in range(0, len(flat), 2)}
        return Lookup(int(depth), tails)

    def touch(self, keys: Sequence[bytes], now: float | None = None, *, tail: bytes | None = None) -> None:
        """Mark a chain prefix ``keys[0..]`` (and a tail hanging from it) as used now; entries that are gone stay gone."""
        writes = self.writes(now)
        writes.touch(keys, tail=tail)
        writes.send()

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

    def add(
        self,
        key: bytes,
        namespace: bytes,
        index: int,
        size: int,
        now: float | None = None,
        *,
        parent: bytes | None = None,
        leaf: bool = False,
    ) -> bool:
        """Index one stored blob (``parent``: the chunk it follows, linked for `drop_tree`); False when it was already indexed.

        A ``leaf`` (a whole-state checkpoint, `store.checkpoints`) has nothing hanging from it
        and sorts like a tail: evicted before any chunk used at the same time.
        """
        writes = self.writes(now)
        writes.add(key, namespace, index, size, parent=parent, leaf=leaf)
        return bool(writes.send()[0])

    def add_tail(
        self, key: bytes, namespace: bytes, index: int, parent: bytes, tokens: bytes, size: int, *, cap: int, now: float | None = None
    ) -> list[bytes] | None:
        """Index one stored tail (``tokens``: its little-endian int32 token ids), keeping ``cap`` per parent.

        Returns the keys of the older tails of the same parent that it pushed out (their
        blobs are the caller's to delete), or None when the tail was already indexed.
        """
        writes = self.writes(now)
        writes.add_tail(key, namespace, index, parent, tokens, size, cap=cap)
        out: list[bytes] | None = writes.send()[0]
        return out

    def add_branch(self, key: bytes, parent: bytes, tokens: bytes, *, cap: int) -> list[bytes]:
        """Offer an indexed full chunk as a candidate of its parent, like a tail (``tokens``: its token ids).

        A prompt that parts from it inside the chunk then resumes where they part: the
        chunk's first cells serve it, as a tail's would. Returns the tails this pushed out.
        """
        writes = self.writes()
        writes.add_branch(key, parent, tokens, cap=cap)
        out: list[bytes] = writes.send()[0]
        return out

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop entries; returns the bytes they accounted for."""
        if not keys:
            return 0
        args = [self.bytes_key, self.prefix, *[k.hex() for k in keys]]
        return int(self._call(lambda: self._remove(keys=[self.lru_key, *[self._chunk(k) for k in keys]], args=args)))

    def script(self, source: str) -> Callable[[list[str], list[Any]], Any]:
        """A Lua script on this index's Redis; a call raises `StoreUnavailable` when Redis cannot be reached."""
        run = self.r.register_script(source)
        return lambda keys, args: self._call(lambda: run(keys=keys, args=args))

    def scan(self, cursor: int, count: int) -> tuple[int, list[IndexEntry]]:
        """One step of a full pass over the entries (Redis's ZSCAN: safe while entries come and go); cursor 0 starts and ends it."""
        cursor, members = self._call(lambda: self.r.zscan(self.lru_key, cursor, count=count))
        keys = [bytes.fromhex(m.decode()) for m, _ in members]
        return int(cursor), [_entry(k, h, score) for k, (_, score), h in zip(keys, members, self._hashes(keys)) if h]

    def _hashes(self, keys: list[bytes]) -> list[Any]:
        def fetch() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(self._chunk(k))
            return pipe.execute()

        return self._call(fetch) if keys else []

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
            for k, (_, score), h in zip(keys, members, self._hashes(keys)):
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
