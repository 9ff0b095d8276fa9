"""A workload at concurrency 4 on the bench model, one worker of 4 sequences, with publishing on and off.

    PYTHONPATH=$PWD .kvpool/venv/bin/python docs/bench/bench-model-2026-12-03/publish_w4.py OUT_DIR [ROUNDS] [WORKLOAD] [CONCURRENCY]

Runs one of `kvpool bench-peers`' workloads (W4 unless WORKLOAD says otherwise: 8 distinct
chat prompts of 540-850 tokens, 32 tokens each), streamed by 4 clients (or CONCURRENCY), on
a pool started as `bench-peers` starts its ``kvpool-1w4s`` system (``kvpool-1w`` at concurrency 1),
with ``KVPOOL_PUBLISH`` true and false in turn, ROUNDS times, and prints one line per run:
wall seconds, the median time to first token, the chunks the worker published, and its
``llama_decode`` calls by kind (``batcher.totals``, logged when the worker stops).
"""

import json
import re
import sys
import tempfile
from pathlib import Path

from gateway.pool.bench.peer_workloads import workloads
from gateway.pool.bench.peers import BenchPoolSettings, run_workload
from gateway.pool.procs import free_port
from gateway.pool.up import LocalPool

MODEL = Path(".kvpool/models/kvpool-bench-s0.gguf")
N_CTX = 4096


def published_chunks(logs: Path) -> int:
    return sum(int(m) for log in logs.glob("*.log") for m in re.findall(r"publish\.done chunks=(\d+)", log.read_text()))


def batcher_totals(logs: Path) -> dict[str, str]:
    """The ``batcher.totals`` line a worker logs when it stops: its ``llama_decode`` calls and their seconds, by kind."""
    for log in logs.glob("*.log"):
        for line in log.read_text().splitlines():
            if " batcher.totals " in line:
                return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    return {}


def one(out: Path, publish: bool, workload: str, concurrency: int) -> dict:
    state = Path(tempfile.mkdtemp(dir=out))
    settings = BenchPoolSettings(model=str(MODEL), port=free_port(), n_ctx=N_CTX, state_dir=state)
    env = {"KVPOOL_PARALLEL": "4" if concurrency > 1 else "1", "KVPOOL_PUBLISH": "true" if publish else "false"}
    pool = LocalPool(settings, workers=1, threads=2, say=lambda _: None, inherit_settings=False, worker_env=env)
    try:
        url = pool.start().url
        wl = workloads(Path("."), "kvpool-bench-s0", (workload,))[0]
        res = run_workload(f"publish={publish}", [url], wl, concurrency)
    finally:
        pool.stop()
    return {
        "workload": workload,
        "concurrency": concurrency,
        "publish": publish,
        "wall_s": round(res.wall_s, 2),
        "ttft_p50_ms": round(res.ttft_p50 * 1000),
        "completion_tokens": res.completion_tokens,
        "published_chunks": published_chunks(state / "logs"),
        "batcher": batcher_totals(state / "logs"),
    }


def main(out: Path, rounds: int, workload: str, concurrency: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for _ in range(rounds):
        for publish in (True, False):
            print(json.dumps(one(out, publish, workload, concurrency)), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0]), int(args[1]) if len(args) > 1 else 2, args[2] if len(args) > 2 else "W4", int(args[3]) if len(args) > 3 else 4)
