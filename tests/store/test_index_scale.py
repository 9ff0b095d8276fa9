"""Routing and lookup cost the same whatever the index holds: a million chunk entries in a real redis-server.

A request's Redis work is reading the adverts and queue lengths (routing) and one
lookup of its chain. Neither may scan the keyspace: with 1,000,000 index entries the
same commands run as with none (`kvpool bench-index` times them).
"""

from __future__ import annotations

import redis

from gateway.pool.bench.index_scale import CHAIN, NAMESPACE, fill, operations
from store.index import RedisIndex
from worker.advert import advertise


def _request(conn: redis.Redis, index: RedisIndex):  # type: ignore[no-untyped-def]
    ops = operations(conn, index)
    return lambda: (ops["route"](), ops["lookup_hit"]())


def _commands(conn: redis.Redis, fn) -> dict[str, int]:  # type: ignore[no-untyped-def]
    conn.config_resetstat()
    fn()
    stats = conn.info("commandstats")
    return {k: v["calls"] for k, v in stats.items() if k not in ("cmdstat_config", "cmdstat_info")}


def test_a_dispatch_with_a_million_index_entries_costs_what_it_does_with_none(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    index = RedisIndex(conn)
    for worker in ("w1", "w2"):
        advertise(conn, worker, CHAIN[:4], busy=False)
    for i, k in enumerate(CHAIN):
        index.add(k, NAMESPACE, i, 1000)
    request = _request(conn, index)
    request()  # scripts loaded
    empty = _commands(conn, request)
    assert not any(name in empty for name in ("cmdstat_scan", "cmdstat_keys")), empty

    fill(conn, 1_000_000)
    for worker in ("w1", "w2"):
        advertise(conn, worker, CHAIN[:4], busy=False)  # live workers refresh their adverts every few seconds
    assert index.count() == 1_000_008
    assert index.lookup(NAMESPACE, CHAIN).depth == 8
    assert _commands(conn, request) == empty, "the same Redis commands, whatever the index holds"
    conn.flushall()
