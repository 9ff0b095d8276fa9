"""Workers advertise what their context holds, so the gateway can route a request to the worker that already has its prefix.

Each worker keeps one short-lived Redis key, ``kvpool:advert:<worker>``, holding the chain
keys of the full chunks in its context (under the tenant that filled it) and whether it is
busy. It is refreshed at every job start and end and at every idle heartbeat, and expires
when the worker stops refreshing it, so the set of adverts is also the set of live workers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

ADVERT_PREFIX = "kvpool:advert:"
ADVERT_TTL_S = 15


@dataclass(frozen=True)
class Advert:
    worker: str
    keys: tuple[str, ...]
    busy: bool
    at: float

    def depth(self, chain: Sequence[str]) -> int:
        """How many leading chunks of ``chain`` this worker's context holds."""
        n = 0
        for a, b in zip(self.keys, chain):
            if a != b:
                break
            n += 1
        return n


def advertise(conn: redis.Redis, worker: str, keys: Sequence[bytes], busy: bool, ttl_s: int = ADVERT_TTL_S) -> None:
    doc = {"keys": [k.hex() for k in keys], "busy": busy, "at": time.time()}
    conn.set(ADVERT_PREFIX + worker, json.dumps(doc), ex=ttl_s)


def withdraw(conn: redis.Redis, worker: str) -> None:
    conn.delete(ADVERT_PREFIX + worker)


def adverts(conn: redis.Redis) -> list[Advert]:
    names = sorted(conn.scan_iter(match=ADVERT_PREFIX + "*", count=1000))
    if not names:
        return []
    out = []
    for name, raw in zip(names, conn.mget(names)):
        if raw is None:
            continue
        doc = json.loads(raw)
        out.append(Advert(name.decode()[len(ADVERT_PREFIX) :], tuple(doc["keys"]), bool(doc["busy"]), float(doc["at"])))
    return out
