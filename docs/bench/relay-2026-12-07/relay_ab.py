"""Decode at four streams over HTTP with the worker's stream interval set, or llama-server 4 slots, and each process's CPU.

One system per run (each started afresh, warmed up as `kvpool bench-peers` does): 16 requests
of 256 greedy tokens at 4 clients (`gateway.pool.bench.peers.decode_run`). ``server``:
llama-server 4 slots; a number: one kvpool worker at default settings but
``KVPOOL_STREAM_INTERVAL_MS`` = that number, with the code of the tree named by ``TREE``
(PYTHONPATH reaches the pool's processes). Prints tokens per second and the CPU seconds of
every process but the computing ones (threads under 3 s each).

    TREE=$PWD PYTHONPATH=$PWD python docs/bench/relay-2026-12-07/relay_ab.py server|INTERVAL_MS
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

from gateway.pool.bench.peers import BenchPoolSettings, _warm_up, decode_run, llama_servers  # noqa: E402
from gateway.pool.procs import free_port  # noqa: E402
from gateway.pool.up import LocalPool  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / ".kvpool/models/SmolLM2-135M-Instruct.Q4_1.gguf"
CLIENTS = 4


def measure(urls: list[str], tag: str) -> None:
    name = MODEL.name.removesuffix(".gguf")
    _warm_up(urls, name)
    before, t0 = cpu_by_thread(), time.perf_counter()
    run = decode_run(tag, urls, name, requests=4 * CLIENTS, concurrency=CLIENTS, max_tokens=256)
    wall, after = time.perf_counter() - t0, cpu_by_thread()
    other: dict[str, float] = {}
    for key, (cmd, cpu) in after.items():
        used = cpu - before.get(key, ("", 0.0))[1]
        if 0.01 < used < 3:
            other[label(cmd)] = round(other.get(label(cmd), 0.0) + used, 2)
    print(f"{tag}: {run.completion_tokens / wall:.1f} tokens/s ({wall:.2f} s); other CPU {other}", flush=True)


def main(which: str) -> None:
    with tempfile.TemporaryDirectory() as state:
        if which == "server":
            server = ROOT / ".kvpool/llama-server/bin/llama-server"
            with llama_servers(server, MODEL, count=1, threads=2, slots=CLIENTS, n_ctx=4096, logs=Path(state)) as urls:
                measure(urls, f"llama-server {CLIENTS} slots")
            return
        settings = BenchPoolSettings(model=str(MODEL), port=free_port(), n_ctx=4096, state_dir=Path(state))
        env = {"KVPOOL_PARALLEL": "0", "KVPOOL_STREAM_INTERVAL_MS": which}
        pool = LocalPool(settings, workers=1, threads=2, say=lambda _: None, inherit_settings=False, worker_env=env)
        try:
            measure([pool.start().url], f"{os.environ.get('TAG', tree.name)} interval {which}")
        finally:
            pool.stop()


if __name__ == "__main__":
    main(sys.argv[1])
