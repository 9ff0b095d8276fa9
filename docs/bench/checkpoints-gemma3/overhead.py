"""Client time against the worker's own time for W1 requests (max_tokens 1), one kvpool worker: where the per-request cost goes."""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from gateway.pool.bench.peer_workloads import workloads
from gateway.pool.bench.peers import BenchPoolSettings
from gateway.pool.procs import free_port
from gateway.pool.up import LocalPool

model = Path(sys.argv[1])
rows = []
with tempfile.TemporaryDirectory() as state:
    settings = BenchPoolSettings(model=str(model), port=free_port(), n_ctx=4096, state_dir=Path(state))
    pool = LocalPool(settings, workers=1, threads=2, say=lambda _: None, inherit_settings=False)
    gw = pool.start()
    try:
        [wl] = workloads(Path.cwd(), model.name.removesuffix(".gguf"), ("W1",))
        with httpx.Client(timeout=600) as c:
            for body in wl.bodies:
                b = {**json.loads(body), "max_tokens": 1, "stream": False}
                t0 = time.perf_counter()
                r = c.post(gw.url + "/v1/chat/completions", json=b)
                t = time.perf_counter() - t0
                k = r.json()["kvpool"]
                tm = k["timings"]
                rows.append((t, tm["total_s"], tm["queue_wait_s"], tm["lookup_s"], tm["first_token_s"], k["evaluated_tokens"]))
    finally:
        pool.stop()
for row in rows:
    print(" ".join(f"{x:.4f}" if isinstance(x, float) else str(x) for x in row))
rest = rows[1:]
print(
    "median client",
    statistics.median(r[0] for r in rest),
    "worker total",
    statistics.median(r[1] for r in rest),
    "overhead",
    statistics.median(r[0] - r[1] for r in rest),
)
