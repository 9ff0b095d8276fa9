"""One workload at 4 clients on one worker of 1 and of 4 sequences, the worker logs kept (``loop.totals``, ``job.done``).

    .kvpool/venv/bin/python docs/bench/siblings/trace_w1.py MODEL [W1] [1,4]

``EXTRA="KVPOOL_GATHER_MS=0 ..."`` adds worker settings; logs go to /tmp/kvpool-trace-<workload>-P<n>/logs/.
"""

import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from gateway.pool.bench.peer_workloads import workloads  # noqa: E402
from gateway.pool.bench.peers import BenchPoolSettings, _warm_up, free_port, run_workload  # noqa: E402
from gateway.pool.up import LocalPool  # noqa: E402


def main() -> None:
    model = Path(sys.argv[1])
    key = sys.argv[2] if len(sys.argv) > 2 else "W1"
    order = [int(p) for p in (sys.argv[3] if len(sys.argv) > 3 else "1,4").split(",")]
    extra = dict(kv.split("=", 1) for kv in os.environ.get("EXTRA", "").split() if kv)
    name = model.name.removesuffix(".gguf")
    wl = workloads(REPO, name, (key,))[0]
    for parallel in order:
        state = Path(f"/tmp/kvpool-trace-{key}-P{parallel}")
        shutil.rmtree(state, ignore_errors=True)
        settings = BenchPoolSettings(model=str(model), port=free_port(), n_ctx=4096, state_dir=state)
        env = {"KVPOOL_PARALLEL": str(parallel), **extra}
        pool = LocalPool(settings, workers=1, threads=2, say=lambda _: None, inherit_settings=False, worker_env=env)
        try:
            gw = pool.start()
            _warm_up([gw.url], name)
            r = run_workload(f"P{parallel}", [gw.url], wl, 4)
            print(
                f"{extra} P={parallel} {key} c=4 wall {r.wall_s:.2f} s ttft p50 {r.ttft_p50 * 1000:.0f} ms "
                f"cached {r.cached_tokens}/{r.prompt_tokens} completion {r.completion_tokens}",
                flush=True,
            )
        finally:
            pool.stop()


if __name__ == "__main__":
    main()
