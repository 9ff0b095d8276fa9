"""Decode at four streams over HTTP, and the CPU each part of the pool spends outside ``llama_decode``.

One kvpool worker at default settings (2 threads) with the code of the tree named by ``TREE``
(PYTHONPATH reaches the pool's processes), warmed up as `kvpool bench-peers` does, then 16
requests of 256 greedy tokens at 4 clients (`gateway.pool.bench.peers.decode_run`). Every
thread's CPU is read from ``/proc`` before and after. The worker's two busiest threads are
the engine loop (which calls ``llama_decode`` and computes in it as thread 0) and llama.cpp's
second compute thread, which does the same share of each decode and nothing else: the loop's
CPU beyond that thread's is the loop's work outside ``llama_decode`` (planning, sampling,
sending tokens). Prints tokens per second and, per 4,096 generated tokens, the CPU seconds
of the gateway, Redis, the worker's other threads and the loop outside decode.

    TREE=$PWD PYTHONPATH=$PWD python docs/bench/loop-sampling-2026-12-07/cpu_ab.py [rounds]
"""

import os
import sys
import tempfile
import time
from pathlib import Path

tree = Path(os.environ.get("TREE", Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(tree))
sys.path.insert(0, str(tree / "docs" / "bench" / "c1-2026-12-06"))
from system_c1 import cpu_by_thread, label  # noqa: E402

from gateway.pool.bench.peers import BenchPoolSettings, _warm_up, decode_run  # noqa: E402
from gateway.pool.procs import free_port  # noqa: E402
from gateway.pool.up import LocalPool  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / ".kvpool/models/SmolLM2-135M-Instruct.Q4_1.gguf"
CLIENTS = 4


def measure(url: str, tag: str) -> None:
    name = MODEL.name.removesuffix(".gguf")
    _warm_up([url], name)
    before, t0 = cpu_by_thread(), time.perf_counter()
    run = decode_run(tag, [url], name, requests=4 * CLIENTS, concurrency=CLIENTS, max_tokens=256)
    wall, after = time.perf_counter() - t0, cpu_by_thread()
    by_part: dict[str, float] = {}
    worker: list[float] = []
    for key, (cmd, cpu) in after.items():
        used = cpu - before.get(key, ("", 0.0))[1]
        part = label(cmd)
        if part == "kvpool worker":
            worker.append(used)
        elif part in ("kvpool gateway", "redis-server"):
            by_part[part] = by_part.get(part, 0.0) + used
    worker.sort(reverse=True)
    loop, peer, rest = worker[0], worker[1], sum(worker[2:])
    per = 4096 / run.completion_tokens
    parts = {**by_part, "worker other threads": rest, "loop outside decode": loop - peer}
    shown = ", ".join(f"{k} {v * per:.2f}" for k, v in parts.items())
    total = sum(parts.values()) * per
    print(
        f"{tag}: {run.completion_tokens / wall:.1f} tokens/s ({wall:.2f} s); CPU s per 4,096 tokens outside decode: {shown}; "
        f"total {total:.2f} (loop {loop:.2f} s, compute peer {peer:.2f} s)",
        flush=True,
    )


def main(rounds: int) -> None:
    for r in range(rounds):
        with tempfile.TemporaryDirectory() as state:
            settings = BenchPoolSettings(model=str(MODEL), port=free_port(), n_ctx=4096, state_dir=Path(state))
            pool = LocalPool(settings, workers=1, threads=2, say=lambda _: None, inherit_settings=False, worker_env={})
            try:
                measure(pool.start().url, f"round {r} {os.environ.get('TAG', tree.name)}")
            finally:
                pool.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
