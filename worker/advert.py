"""Workers advertise what their context holds, so the gateway can route a request to the worker that already has its prefix.

All adverts live in one Redis hash, ``kvpool:adverts``: field = worker name, value =
JSON with the prefix keys (`store.chain.prefix_namespace`) of the full chunks the
worker's context holds (under the tenant that filled it), whether it is busy, its pid
and host, what the pool must agree on (the model's fingerprint, the chunk size) the
worker's KV layout and kernel fingerprint (`worker.kernels`: which workers' blobs it can
restore), and ``at``, the Redis server's clock when it was written. A worker rewrites its advert at every job start
and end, every idle heartbeat and every few seconds while busy.

An advert is *live* while ``at`` is less than `LIVE_S` old by the same Redis clock, so
liveness never rests on a key that outlived its worker (a restarted Redis keeps its
keys) nor on the clocks of the machines. Reading every live worker is one ``HGETALL``
however large the chunk index in the same Redis grows; adverts dead for longer than
`FORGET_S` are removed by whoever reads them.

A pool also says whether it is *starting*, so that a request finding no live worker can
tell a pool whose first workers are still loading (it waits for one) from one whose
workers died (503 at once): a worker process is announced in `STARTING_KEY` the moment it
is spawned and keeps announcing itself while its model loads (`announce_starting`); its
first advert removes the announcement in the same script. Every advert also records its
model and chunk size in `SEEN_KEY`, which never expires: a pool that has had a live
worker in this Redis (`apool_view`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from worker.protocol import ADVERTS_KEY

LIVE_S = 10.0
"""An advert older than this is a worker that stopped: at least twice its longest refresh interval."""
FORGET_S = 300.0

STARTING_KEY = "kvpool:starting"
"""Hash of worker process (``host:pid``) -> the Redis clock until which it counts as starting (`announce_starting`)."""
SEEN_KEY = "kvpool:adverts:seen"
"""Hash of ``model:chunk size`` -> the Redis clock when a worker serving them last advertised; never expires."""

_WRITE = """
local t = redis.call('TIME')
local doc = cjson.decode(ARGV[2])
doc['at'] = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(doc))
redis.call('HDEL', KEYS[2], ARGV[3])
if doc['model'] then
  redis.call('HSET', KEYS[3], doc['model'] .. ':' .. tostring(doc['chunk_size']), t[1])
end
return 1
"""

_ANNOUNCE = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2]))
return 1
"""


@dataclass(frozen=True)
class Advert:
    worker: str
    keys: tuple[str, ...]
    busy: bool
    at: float
    pid: int = 0
    host: str = ""
    model: str = ""
    chunk_size: int = 0
    layout: str = ""
    pending: int = 0
    """Publish tasks not finished yet: 0 on an idle worker once everything it evaluated is in the store."""
    kernels: str = ""
    """The worker's kernel fingerprint, canonical (its digest, or ``any``, is in ``layout``)."""
    decode: str = ""
    """How the worker decodes generated tokens (`worker.engine.decoding.DecodeMode`): ``settle`` when not exactly."""
    sequences: int = 1
    """The sequences of the worker process (``KVPOOL_PARALLEL`` as resolved for its model), each advertised as ``name.i``."""

    def serves(self, model: str, chunk_size: int) -> bool:
        """Whether this worker can run a job of this model and chunk size."""
        return self.model == model and self.chunk_size == chunk_size

    def depth(self, chain: Sequence[str]) -> int:
        """How many leading chunks of ``chain`` this worker's context holds."""
        n = 0
        for a, b in zip(self.keys, chain):
            if a != b:
                break
            n += 1
        return n


@dataclass(frozen=True)
class Serving:
    """What a worker serves: the pool must agree on the model and chunk size; layouts (and kernels) may differ."""

    model: str
    chunk_size: int
    layout: str
    kernels: str = ""
    decode: str = ""
    sequences: int = 1


def advertise(
    conn: redis.Redis,
    worker: str,
    keys: Sequence[bytes],
    busy: bool,
    *,
    pid: int = 0,
    host: str = "",
    serving: Serving | None = None,
    pending: int = 0,
) -> None:
    doc: dict[str, object] = {"keys": [k.hex() for k in keys], "busy": busy, "pid": pid, "host": host, "pending": pending}
    if serving is not None:
        doc.update(
            model=serving.model,
            chunk_size=serving.chunk_size,
            layout=serving.layout,
            kernels=serving.kernels,
            decode=serving.decode,
            sequences=serving.sequences,
        )
    conn.eval(_WRITE, 3, ADVERTS_KEY, STARTING_KEY, SEEN_KEY, worker, json.dumps(doc), process_key(host, pid))


def process_key(host: str, pid: int) -> str:
    """How `STARTING_KEY` names a worker process."""
    return f"{host}:{pid}"


def announce_starting(conn: redis.Redis, host: str, pid: int, for_s: float = LIVE_S) -> None:
    """Worker process ``host:pid`` is starting, and counts as starting for ``for_s`` by the Redis clock unless announced again."""
    conn.eval(_ANNOUNCE, 1, STARTING_KEY, process_key(host, pid), str(for_s))


def withdraw_starting(conn: redis.Redis, host: str, pid: int) -> None:
    conn.hdel(STARTING_KEY, process_key(host, pid))


def withdraw(conn: redis.Redis, worker: str) -> None:
    conn.hdel(ADVERTS_KEY, worker)


def adverts(conn: redis.Redis) -> list[Advert]:
    """The live workers' adverts, by name."""
    pipe = conn.pipeline(transaction=False)
    pipe.time()
    pipe.hgetall(ADVERTS_KEY)
    (sec, usec), raw = pipe.execute()
    out, forget = _live(raw, sec + usec / 1e6)
    if forget:
        conn.hdel(ADVERTS_KEY, *forget)
    return out


def _live(raw: dict[bytes, bytes], now: float) -> tuple[list[Advert], list[bytes]]:
    """The live adverts among ``raw``, by name, and the names of those dead long enough to forget."""
    out, forget = [], []
    for name, value in sorted(raw.items()):
        doc = json.loads(value)
        age = now - float(doc.get("at", 0))
        if age > FORGET_S:
            forget.append(name)
        if age <= LIVE_S:
            out.append(_advert(name.decode(), doc))
    return out, forget


@dataclass(frozen=True)
class PoolView:
    """What a gateway with no live worker to send a job to must know: is the pool starting, or are its workers gone?"""

    live: list[Advert]
    """The live workers, whatever they serve."""
    starting: int
    """Worker processes announced as starting (spawned, or loading their model) and not advertising yet."""
    seen: bool
    """A worker serving this model and chunk size has advertised in this Redis before (`SEEN_KEY`)."""


async def apool_view(conn: redis.asyncio.Redis, model: str, chunk_size: int) -> PoolView:
    """The pool as a gateway of ``model`` and ``chunk_size`` sees it, in one round trip (for asyncio)."""
    pipe = conn.pipeline(transaction=False)
    pipe.time()
    pipe.hgetall(ADVERTS_KEY)
    pipe.hgetall(STARTING_KEY)
    pipe.hexists(SEEN_KEY, f"{model}:{chunk_size}")
    (sec, usec), raw, starting, seen = await pipe.execute()
    now = sec + usec / 1e6
    fresh = [k for k, until in starting.items() if float(until) >= now]
    stale = [k for k, until in starting.items() if float(until) < now - FORGET_S]
    if stale:
        await conn.hdel(STARTING_KEY, *stale)
    return PoolView(_live(raw, now)[0], len(fresh), bool(seen))


def _advert(name: str, doc: dict[str, Any]) -> Advert:
    return Advert(
        name,
        tuple(doc["keys"]),
        bool(doc["busy"]),
        float(doc["at"]),
        int(doc.get("pid", 0)),
        str(doc.get("host", "")),
        str(doc.get("model", "")),
        int(doc.get("chunk_size", 0)),
        str(doc.get("layout", "")),
        int(doc.get("pending", 0)),
        str(doc.get("kernels", "")),
        str(doc.get("decode", "")),
        int(doc.get("sequences", 1)),
    )


def _fresh(raw: bytes | None, sec: int, usec: int) -> bool:
    return raw is not None and sec + usec / 1e6 - float(json.loads(raw).get("at", 0)) <= LIVE_S


def is_live(conn: redis.Redis, worker: str) -> bool:
    """Whether ``worker`` has a live advert (one round trip, whatever the pool's size)."""
    pipe = conn.pipeline(transaction=False)
    pipe.time()
    pipe.hget(ADVERTS_KEY, worker)
    (sec, usec), raw = pipe.execute()
    return _fresh(raw, sec, usec)


async def ais_live(conn: redis.asyncio.Redis, worker: str) -> bool:
    """`is_live` for asyncio."""
    pipe = conn.pipeline(transaction=False)
    pipe.time()
    pipe.hget(ADVERTS_KEY, worker)
    (sec, usec), raw = await pipe.execute()
    return _fresh(raw, sec, usec)
