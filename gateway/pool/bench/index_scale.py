"""``kvpool bench-index``: what routing and the chunk index cost when Redis holds a million chunks.

Fills a real redis-server with ``N`` index entries, written by the same script the store
uses to index a published chunk (`store.index_lua.ADD`), run server-side in batches so a
million entries take seconds rather than a million round trips. Then, with N entries and
with none, it times the Redis work of each request-path operation from a client on
loopback:

* ``route``: what the gateway reads to route a request (every live advert, the queue
  lengths), as `gateway.dispatch.Dispatcher` does;
* ``lookup``: `store.index.RedisIndex.lookup` of a 2,048-token prompt (8 chunks), found
  and not found;
* ``publish``: indexing one new chunk (`RedisIndex.add`);
* ``touch``: marking an 8-chunk prefix as used;
* ``gc``: one eviction step of 64 entries (`coldest`, `get`, `remove`).

It reports p50 and p99 in milliseconds, Redis's memory per entry (``used_memory``
before and after the fill, divided by N) and the server-side time of each operation
from ``INFO commandstats``, which no client-side noise reaches.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import click
import redis

from gateway.pool.procs import RedisServer
from store.index import RedisIndex
from store.index_lua import ADD
from worker.advert import advertise, adverts
from worker.protocol import worker_queue

CHAIN = [bytes([i]) * 16 for i in range(1, 9)]
MISS = [bytes([0xF0 + i]) * 16 for i in range(8)]
NAMESPACE = b"\x07" * 16
BATCH = 20_000

# Run the store's own indexing script for entries i0..i1 with synthetic keys, server-side.
_FILL = (
    "local function add(KEYS, ARGV)\n"
    + ADD.strip()
    + "\nend\n"
    + """
local prefix, i0, i1, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
for i = i0, i1 - 1 do
  local key = string.format('%032x', i)
  add({prefix .. 'chunk:' .. key, prefix .. 'lru', prefix .. 'bytes'},
      {ARGV[5], tostring(i % 16), '5800000', tostring(now), string.format('%.0f', now * 32768 + i % 32768), key})
end
return i1 - i0
"""
)


def fill(conn: redis.Redis[bytes], n: int, prefix: str = "kvpool:v1:") -> None:
    """Index ``n`` synthetic chunks, as the store would have, ``BATCH`` per server-side call."""
    script = conn.register_script(_FILL)
    now = int((time.time() - 1_577_836_800) * 100)
    for i0 in range(0, n, BATCH):
        script(args=[prefix, i0 + 1, min(n, i0 + BATCH) + 1, now, NAMESPACE.hex()])


def _route(conn: redis.Redis[bytes]) -> None:
    ads = adverts(conn)
    pipe = conn.pipeline(transaction=False)
    for a in ads:
        pipe.llen(f"rq:queue:{worker_queue(a.worker)}")
    pipe.llen("rq:queue:kvpool")
    pipe.execute()


def operations(conn: redis.Redis[bytes], index: RedisIndex) -> dict[str, Callable[[], object]]:
    counter = iter(range(10**9))
    return {
        "route": lambda: _route(conn),
        "lookup_hit": lambda: index.lookup(NAMESPACE, CHAIN),
        "lookup_miss": lambda: index.lookup(NAMESPACE, MISS),
        "publish": lambda: index.add(os.urandom(16), NAMESPACE, next(counter) % 8, 5_800_000),
        "touch": lambda: index.touch(CHAIN),
        "gc_step": lambda: index.remove([e.key for e in (index.get(k) for k in index.coldest(64)) if e is not None]),
    }


def _time(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    samples.sort()
    return {"p50_ms": statistics.median(samples), "p99_ms": samples[int(len(samples) * 0.99) - 1]}


def server_usec(conn: redis.Redis[bytes], fn: Callable[[], object], repeats: int) -> float:
    """Server-side microseconds one call of ``fn`` costs Redis (commands and scripts), from ``INFO commandstats``."""
    conn.config_resetstat()
    for _ in range(repeats):
        fn()
    stats = conn.info("commandstats")
    total: float = sum(v["usec"] for k, v in stats.items() if k not in ("cmdstat_config", "cmdstat_info"))
    return total / repeats


def measure(conn: redis.Redis[bytes], entries: int, repeats: int = 500) -> dict[str, object]:
    index = RedisIndex(conn)
    for i, k in enumerate(CHAIN):
        index.add(k, NAMESPACE, i, 5_800_000)
    ops = operations(conn, index)
    before = conn.info("memory")["used_memory"]
    t0 = time.perf_counter()
    fill(conn, entries)
    fill_s = time.perf_counter() - t0
    after = conn.info("memory")["used_memory"]
    for name in ("w1", "w2"):
        advertise(conn, name, CHAIN[:4], busy=False)  # after the fill: an advert lives for 10 s
    result: dict[str, object] = {
        "entries": index.count(),
        "fill_s": round(fill_s, 2),
        "bytes_per_entry": round((after - before) / entries, 1) if entries else None,
    }
    for name, fn in ops.items():
        result[name] = {**_time(fn, repeats), "server_us": round(server_usec(conn, fn, repeats), 1)}
    return result


@click.command("bench-index")
@click.option("--entries", type=click.IntRange(min=1), default=1_000_000, show_default=True, help="Index entries to fill Redis with.")
@click.option("--repeats", type=click.IntRange(min=10), default=500, show_default=True, help="Calls timed per operation.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Also write index-scale.json into this folder.")
def bench_index_command(entries: int, repeats: int, out: Path | None) -> None:
    """Time routing and the chunk index with no entries and with ENTRIES, on a redis-server started here."""
    import tempfile

    rows = []
    for n in (0, entries):
        with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as server:
            conn = redis.Redis.from_url(server.url)
            rows.append(measure(conn, n, repeats))
    doc = {"redis": _redis_version(), "runs": rows}
    click.echo(json.dumps(doc, indent=2))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "index-scale.json").write_text(json.dumps(doc, indent=2) + "\n")


def _redis_version() -> str:
    import subprocess

    return subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
