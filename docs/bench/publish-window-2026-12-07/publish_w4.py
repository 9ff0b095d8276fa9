"""W4 at one client, request by request, on the default worker with publishing on and off, and llama-server 1 slot.

    PYTHONPATH=$PWD .kvpool/venv/bin/python docs/bench/publish-window-2026-12-07/publish_w4.py OUT_DIR [ROUNDS]

As docs/bench/w4-publish-2026-12-03/trace_w4.py (whose request loop it runs), but the worker
at default settings (4 sequences on this model, flash attention, exact decoding, the cells
from the first chunk the store lacks copied for publishing) and the worker process's CPU
per round, from /proc, so that publishing's CPU per request shows as the difference.
"""

import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gateway.pool.bench.peer_workloads import workloads
from gateway.pool.bench.peers import BenchPoolSettings, llama_servers
from gateway.pool.procs import free_port
from gateway.pool.up import LocalPool

spec = importlib.util.spec_from_file_location("trace_w4", Path(__file__).parents[1] / "w4-publish-2026-12-03" / "trace_w4.py")
trace_w4 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_w4)
TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TCK


@contextmanager
def kvpool(out: Path, publish: bool) -> Iterator[tuple[str, int]]:
    settings = BenchPoolSettings(
        model=str(trace_w4.MODEL), port=free_port(), n_ctx=trace_w4.N_CTX, state_dir=Path(tempfile.mkdtemp(dir=out))
    )
    env = {"KVPOOL_PUBLISH": "true" if publish else "false"}
    pool = LocalPool(settings, workers=1, threads=2, say=lambda _: None, inherit_settings=False, worker_env=env)
    try:
        url = pool.start().url
        yield url, pool.workers[0].proc.pid
    finally:
        pool.stop()


def main(out: Path, rounds: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    bodies = workloads(Path("."), trace_w4.MODEL.name.removesuffix(".gguf"), ("W4",))[0].bodies
    for rnd in range(rounds):
        for label in ("llama-server 1 slot", "kvpool 1w", "kvpool 1w, KVPOOL_PUBLISH=false"):
            cpu = ""
            if label.startswith("llama-server"):
                with llama_servers(trace_w4.SERVER, trace_w4.MODEL, count=1, threads=2, slots=1, n_ctx=trace_w4.N_CTX, logs=out) as urls:
                    rows = trace_w4.run(urls[0], bodies, label)
            else:
                with kvpool(out, publish="PUBLISH" not in label) as (url, pid):
                    before = cpu_s(pid)
                    rows = trace_w4.run(url, bodies, label)
                    cpu = f" | worker process CPU {cpu_s(pid) - before:.2f} s"
            first = sum(r["first_token_s"] for r in rows)
            after = sum(r["total_s"] - r["first_token_s"] for r in rows)
            print(f"SUM round {rnd + 1} | {label} | first tokens {first:.2f} s | first token to end {after:.2f} s{cpu}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3)
