"""Decode over HTTP at ``CONC`` clients (4 by default): CPU of each part of the pool and Redis commands, per 4,096 generated tokens.

One kvpool worker at default settings (2 threads) with the code of the tree named by ``TREE``
(PYTHONPATH reaches the pool's processes), warmed up as `kvpool bench-peers` does, then
``4 * CONC`` requests of 256 greedy tokens at ``CONC`` clients (`gateway.pool.bench.peers.decode_run`).
The CPU of every thread is read from ``/proc`` before and after (the worker's emitter thread
named by ``py-spy dump``, ``PYSPY``), Redis's command counts from ``INFO commandstats``: an MGET is one emitter write
(its pipeline's cancel read), an XADD one stream entry, an XREAD one read of the gateway's reader.

    TREE=$PWD PYTHONPATH=$PWD CONC=4 PYSPY=py-spy python docs/bench/round-writes-2026-12-07/writes_ab.py
"""

import os
import sys
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[3]
tree = Path(os.environ.get("TREE", ROOT))
sys.path.insert(0, str(tree))
sys.path.insert(0, str(ROOT / "docs" / "bench" / "c1-2026-12-06"))
sys.path.insert(0, str(ROOT / "docs" / "bench" / "stream-entries-2026-12-07"))
from cpu_threads import names, warm_pool  # noqa: E402
from system_c1 import cpu_by_thread, label  # noqa: E402

from gateway.pool.bench.peers import decode_run  # noqa: E402

COMMANDS = ("mget", "xadd", "xread")


def commands(conn: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in conn.info("commandstats").items()}


def main() -> None:
    conc = int(os.environ.get("CONC", "4"))
    with warm_pool() as (pool, url, name):
        conn = redis.Redis.from_url(pool.redis.url)
        before, calls, t0 = cpu_by_thread(), commands(conn), time.perf_counter()
        run = decode_run("x", [url], name, requests=4 * conc, concurrency=conc, max_tokens=256)
        wall, after, calls_after = time.perf_counter() - t0, cpu_by_thread(), commands(conn)
        per = 4096 / run.completion_tokens
        worker_threads = {pid: names(pid) for pid in {pid for (pid, _), (cmd, _) in after.items() if label(cmd) == "kvpool worker"}}
        cpu = {"gateway": 0.0, "emitter": 0.0, "redis": 0.0}
        for (pid, tid), (cmd, used) in after.items():
            used = (used - before.get((pid, tid), ("", 0.0))[1]) * per
            part = label(cmd)
            if part == "kvpool gateway":
                cpu["gateway"] += used
            elif part == "redis-server":
                cpu["redis"] += used
            elif part == "kvpool worker" and worker_threads[pid].get(tid) == "kvpool-emitter":
                cpu["emitter"] += used
        counts = {c: round((calls_after.get(c, 0) - calls.get(c, 0)) * per) for c in COMMANDS}
        print(
            f"{tree.name:6s} {conc} clients  {run.completion_tokens / wall:6.1f} tokens/s  CPU s per 4,096 tokens: "
            + "  ".join(f"{k} {v:.2f}" for k, v in cpu.items())
            + "  commands per 4,096 tokens: "
            + "  ".join(f"{k} {v}" for k, v in counts.items())
        )


if __name__ == "__main__":
    main()
