"""Decode over HTTP at ``CONC`` clients (4 by default), and the CPU of every thread of the pool per 4,096 generated tokens.

One kvpool worker at default settings (2 threads) with the code of the tree named by ``TREE``
(PYTHONPATH reaches the pool's processes), warmed up as `kvpool bench-peers` does, then
``4 * CONC`` requests of 256 greedy tokens at ``CONC`` clients (`gateway.pool.bench.peers.decode_run`).
Every thread's CPU is read from ``/proc`` before and after, and named with ``py-spy dump``
(``PYSPY``, optional: without it threads show their ids). The engine loop and llama.cpp's
second compute thread are the two busiest; the gateway's main thread, the worker's emitter
and Redis are the token path outside ``llama_decode``.

    TREE=$PWD PYTHONPATH=$PWD CONC=4 python docs/bench/stream-entries-2026-12-07/cpu_threads.py
"""

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
tree = Path(os.environ.get("TREE", ROOT))
sys.path.insert(0, str(tree))
sys.path.insert(0, str(ROOT / "docs" / "bench" / "c1-2026-12-06"))
from system_c1 import cpu_by_thread, label  # noqa: E402

from gateway.pool.bench.peers import BenchPoolSettings, _warm_up, decode_run  # noqa: E402
from gateway.pool.procs import free_port  # noqa: E402
from gateway.pool.up import LocalPool  # noqa: E402

MODEL = ROOT / ".kvpool/models/SmolLM2-135M-Instruct.Q4_1.gguf"
PARTS = ("kvpool worker", "kvpool gateway", "redis-server")


def names(pid: str) -> dict[str, str]:
    spy = os.environ.get("PYSPY")
    if not spy:
        return {}
    out = subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True).stdout
    return {m.group(1): m.group(2) for m in re.finditer(r"Thread (\d+) \([^)]*\): \"([^\"]+)\"", out)}


@contextmanager
def warm_pool() -> Iterator[tuple[LocalPool, str, str]]:
    """One default worker (SmolLM2, 2 threads), its gateway and Redis, warmed up as `kvpool bench-peers` does: pool, URL, model name."""
    with tempfile.TemporaryDirectory() as state:
        settings = BenchPoolSettings(model=str(MODEL), port=free_port(), n_ctx=4096, state_dir=Path(state))
        pool = LocalPool(settings, workers=1, threads=2, say=lambda _: None, inherit_settings=False, worker_env={})
        try:
            url = pool.start().url
            name = MODEL.name.removesuffix(".gguf")
            _warm_up([url], name)
            yield pool, url, name
        finally:
            pool.stop()


def main() -> None:
    conc = int(os.environ.get("CONC", "4"))
    with warm_pool() as (_, url, name):
        before, t0 = cpu_by_thread(), time.perf_counter()
        run = decode_run("x", [url], name, requests=4 * conc, concurrency=conc, max_tokens=256)
        wall, after = time.perf_counter() - t0, cpu_by_thread()
        per = 4096 / run.completion_tokens
        thread_names = {pid: names(pid) for (pid, _), (cmd, _) in after.items() if label(cmd) in PARTS[:2]}
        print(f"{tree.name} at {conc} clients: {run.completion_tokens / wall:.1f} tokens/s; CPU s per 4,096 tokens:")
        rows = []
        for (pid, tid), (cmd, cpu) in after.items():
            used = (cpu - before.get((pid, tid), ("", 0.0))[1]) * per
            if used > 0.02 and label(cmd) in PARTS:
                rows.append((used, label(cmd), thread_names.get(pid, {}).get(tid, tid)))
        for used, part, thread in sorted(rows, reverse=True):
            print(f"  {used:6.2f}  {part:15s} {thread}")


if __name__ == "__main__":
    main()
