"""Index writes sent together: a publish's entries, candidates and touches in one pipelined round trip.

Each write is one of the index's Lua scripts (`store.index_lua`) or one ``ZADD``, so each
stays atomic on its own; a pipeline sends them in order and reads every answer back at
once. Order matters: a touch only moves entries already indexed (``ZADD XX``), so it is
queued after the entries it touches. `RedisIndex`'s single writes are one-write batches.

Also here: the eviction score every write sets (see `store.index` on eviction order).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import redis

from store import index_lua as lua
from store.chain import Namespace, token_bytes

T = TypeVar("T")

NewTail = tuple[bytes, np.ndarray, int]
"""A tail a publish wrote: its key, its tokens, its blob's size."""

DEPTH_SLOTS = 2**15
TAIL_DEPTH = DEPTH_SLOTS - 1
_EPOCH = 1_577_836_800


def lru_score(now: float, depth: int) -> int:
    return int((now - _EPOCH) * 100) * DEPTH_SLOTS + (DEPTH_SLOTS - 1 - min(depth, DEPTH_SLOTS - 1))


def score_time(score: float) -> float:
    return (int(score) // DEPTH_SLOTS) / 100 + _EPOCH


def _pushed(out: Any) -> list[bytes]:
    return [bytes.fromhex(k.decode()) for k in out]


class IndexScripts:
    """The index's Redis client, key names and write scripts (`store.index_lua`), shared by `RedisIndex` and `IndexWrites`."""

    def __init__(self, client: redis.Redis[bytes], prefix: str) -> None:
        self.r = client
        self.prefix = prefix
        self.lru_key = prefix + "lru"
        self.bytes_key = prefix + "bytes"
        self._add = client.register_script(lua.ADD)
        self._add_tail = client.register_script(lua.ADD_TAIL)
        self._add_branch = client.register_script(lua.ADD_BRANCH)

    def _chunk(self, key: bytes) -> str:
        return f"{self.prefix}chunk:{key.hex()}"


class IndexWrites:
    """Writes to one index, queued in order; `send` runs them in one round trip and returns each one's answer.

    ``call`` runs the round trip, mapping a lost Redis to `StoreUnavailable` (`RedisIndex._call`).
    """

    def __init__(self, index: IndexScripts, call: Callable[[Callable[[], list[Any]]], list[Any]], now: float | None = None) -> None:
        self.index = index
        self.call = call
        self.now = time.time() if now is None else now
        self._queued: list[tuple[Callable[[Any], object], Callable[[Any], Any]]] = []
        """(queue it on a pipeline, read its answer)"""

    def add(self, key: bytes, namespace: bytes, index: int, size: int, *, parent: bytes | None = None, leaf: bool = False) -> None:
        """`RedisIndex.add`; answers True when the entry is new."""
        ix, t = self.index, self.now
        args = [
            namespace.hex(),
            index,
            size,
            repr(t),
            lru_score(t, TAIL_DEPTH if leaf else index),
            key.hex(),
            parent.hex() if parent else "",
        ]
        keys = [ix._chunk(key), ix.lru_key, ix.bytes_key, *([f"{ix.prefix}children:{parent.hex()}"] if parent else [])]
        self._queued.append((lambda pipe: ix._add(keys=keys, args=args, client=pipe), bool))

    def add_tail(self, key: bytes, namespace: bytes, index: int, parent: bytes, tokens: bytes, size: int, *, cap: int) -> None:
        """`RedisIndex.add_tail`; answers the tails it pushed out, or None when it was indexed already."""
        ix, t = self.index, self.now
        args = [namespace.hex(), index, size, repr(t), lru_score(t, TAIL_DEPTH), key.hex(), parent.hex(), tokens, cap, ix.prefix]
        keys = [ix._chunk(key), ix.lru_key, ix.bytes_key, f"{ix.prefix}tails:{parent.hex()}"]
        self._queued.append(
            (lambda pipe: ix._add_tail(keys=keys, args=args, client=pipe), lambda out: None if out is None else _pushed(out))
        )

    def add_branch(self, key: bytes, parent: bytes, tokens: bytes, *, cap: int) -> None:
        """`RedisIndex.add_branch`; answers the tails it pushed out."""
        ix = self.index
        args = [key.hex(), parent.hex(), tokens, cap, ix.prefix]
        keys = [ix._chunk(key), ix.lru_key, ix.bytes_key, f"{ix.prefix}tails:{parent.hex()}"]
        self._queued.append((lambda pipe: ix._add_branch(keys=keys, args=args, client=pipe), _pushed))

    def touch(self, keys: Sequence[bytes], *, tail: bytes | None = None) -> None:
        """`RedisIndex.touch`: a chain prefix (and a tail hanging from it) used now; answers nothing useful."""
        mapping: dict[str | bytes, float] = {k.hex(): lru_score(self.now, depth) for depth, k in enumerate(keys)}
        if tail is not None:
            mapping[tail.hex()] = lru_score(self.now, TAIL_DEPTH)
        if mapping:
            lru = self.index.lru_key
            self._queued.append((lambda pipe: pipe.zadd(lru, mapping, xx=True, gt=True), lambda out: out))

    def send(self) -> list[Any]:
        """Run every queued write in one round trip; raises `StoreUnavailable` when Redis cannot be reached."""
        if not self._queued:
            return []

        def run() -> list[Any]:
            pipe = self.index.r.pipeline(transaction=False)
            for queue, _ in self._queued:
                queue(pipe)
            return pipe.execute()

        return [read(out) for (_, read), out in zip(self._queued, self.call(run))]


def publish_writes(
    writes: IndexWrites,
    ns: Namespace,
    tokens: Sequence[int] | np.ndarray,
    keys: Sequence[bytes],
    written: Sequence[tuple[int, int]],
    tail: NewTail | None,
    cap: int,
) -> IndexWrites:
    """The index writes of one publish (`store.store.Store.publish`): its new chunks (chunk index, blob size), the
    prompt's last full chunk offered as a candidate when it is new (where the next prompts most often part), and its
    new tail; the caller queues the touch and sends them."""
    c, last, depth = ns.chunk_size, len(keys) - 1, len(keys)
    for i, size in written:
        writes.add(keys[i], ns.key, i, size, parent=keys[i - 1] if i else None)
    if any(i == last for i, _ in written):
        writes.add_branch(keys[last], ns.parent_of(keys, last), token_bytes(tokens[last * c : depth * c]), cap=cap)
    if tail is not None:
        writes.add_tail(tail[0], ns.key, depth, ns.parent_of(keys, depth), token_bytes(tail[1]), tail[2], cap=cap)
    return writes


def read_publish(
    answers: list[Any], written: Sequence[tuple[int, int]], keys: Sequence[bytes], tail: NewTail | None
) -> tuple[int, list[tuple[int, bytes]]]:
    """From `publish_writes`' answers: how many entries were new, and the candidates pushed out (chunk index, key)."""
    out, last = iter(answers), len(keys) - 1
    added = sum(bool(next(out)) for _ in written)
    pushed = [(last, k) for k in next(out)] if any(i == last for i, _ in written) else []
    if tail is not None:
        got = next(out)
        added += got is not None
        pushed += [(len(keys), k) for k in got or []]
    return added, pushed
