"""W2 at concurrency 1 on one worker of 1 and of 4 sequences: where the 4-sequence worker's extra time goes.

    PYTHONPATH=$PWD .kvpool/venv/bin/python docs/bench/parallel-c1-2026-12-03/trace_c1.py OUT_DIR [ROUNDS] [--active]

Runs `kvpool bench-peers`' W2 (5 chats x 4 turns, 32 tokens each, streamed, one request at
a time) on a pool started as `bench-peers` starts it, with ``KVPOOL_PARALLEL`` 1 and 4 in
turn, ROUNDS times, and splits each request's time with the worker's own ``job.done`` log
line: the client's time to first token = (gateway, queue, job start) + the worker's ``ttft_s``;
the worker's ``total_s - ttft_s`` is decoding the rest. Prints one ``SUM`` line per system
and round (seconds, summed over the 20 requests) and the cached tokens by source.
"""

import json
import sys
import tempfile
from pathlib import Path

from gateway.pool.bench.peer_workloads import workloads
from gateway.pool.bench.peers import BenchPoolSettings, run_workload
from gateway.pool.procs import free_port
from gateway.pool.up import LocalPool

MODEL = Path(".kvpool/models/SmolLM2-135M-Instruct.Q4_1.gguf")
N_CTX = 4096


def jobs_done(logs: Path) -> list[dict]:
    """The worker's ``job.done`` lines (logfmt), in order."""
    rows = []
    for log in sorted(logs.glob("*.log")):
        for line in log.read_text().splitlines():
            if " job.done " in line:
                rows.append(dict(kv.split("=", 1) for kv in line.split() if "=" in kv))
    return rows


SYSTEMS = {"1": {"KVPOOL_PARALLEL": "1"}, "4": {"KVPOOL_PARALLEL": "4"}}
ACTIVE = {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "1000"}
"""``--active``: also run both with libgomp's throttled spin raised from 100 to 1000 (see docs/bench/libgomp-2026-12-03)."""


def one(out: Path, system: str, env: dict[str, str]) -> dict:
    state = Path(tempfile.mkdtemp(dir=out))
    settings = BenchPoolSettings(model=str(MODEL), port=free_port(), n_ctx=N_CTX, state_dir=state)
    pool = LocalPool(settings, workers=1, threads=2, say=lambda _: None, inherit_settings=False, worker_env=env)
    try:
        url = pool.start().url
        wl = workloads(Path("."), MODEL.name.removesuffix(".gguf"), ("W2",))[0]
        res = run_workload(system, [url], wl, 1)
    finally:
        pool.stop()
    done = jobs_done(state / "logs")
    worker_ttft = sum(float(d["ttft_s"]) for d in done)
    decode = sum(float(d["total_s"]) - float(d["ttft_s"]) for d in done)
    return {
        "system": system,
        "wall_s": round(res.wall_s, 3),
        "client_ttft_s": round(sum(res.ttft_s), 3),
        "worker_ttft_s": round(worker_ttft, 3),
        "before_job_s": round(sum(res.ttft_s) - worker_ttft, 3),
        "worker_decode_s": round(decode, 3),
        "completion_tokens": res.completion_tokens,
        "cached_context": sum(int(d["cached_context"]) for d in done),
        "cached_store": sum(int(d["cached_store"]) for d in done),
        "jobs": len(done),
    }


def main(out: Path, rounds: int, active: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    systems = {**SYSTEMS, **({f"{k}+active": {**v, **ACTIVE} for k, v in SYSTEMS.items()} if active else {})}
    for rnd in range(rounds):
        for system, env in systems.items():
            print("SUM", rnd + 1, json.dumps(one(out, system, env)), flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--active"]
    main(Path(args[0]), int(args[1]) if len(args) > 1 else 3, "--active" in sys.argv)
