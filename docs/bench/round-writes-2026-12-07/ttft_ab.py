"""Time to first token and to the end of a short answer at one client, through one default worker (SmolLM2, 2 threads).

25 streamed requests of 16 greedy tokens behind one 1,500-token system prompt (the first
evaluates it, the rest restore it: medians over those 24), with the code of the tree named by ``TREE``:

    TREE=$PWD PYTHONPATH=$PWD python docs/bench/round-writes-2026-12-07/ttft_ab.py
"""

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
tree = Path(os.environ.get("TREE", ROOT))
sys.path.insert(0, str(tree))

import httpx  # noqa: E402

from gateway.pool.bench.peers import BenchPoolSettings, _warm_up  # noqa: E402
from gateway.pool.procs import free_port  # noqa: E402
from gateway.pool.up import LocalPool  # noqa: E402

MODEL = ROOT / ".kvpool/models/SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = " ".join(f"rule {i}: be kind and brief." for i in range(150))


def has_text(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[6:])["choices"]
    return bool(choices and choices[0].get("delta", {}).get("content"))


def one(client: httpx.Client, url: str, name: str, i: int) -> tuple[float, float]:
    """Seconds to the first text and to the end of one streamed answer."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}: what is {i} plus {i}?"}]
    body = {"model": name, "stream": True, "max_tokens": 16, "temperature": 0, "messages": messages}
    t0, first = time.perf_counter(), 0.0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not first and has_text(line):
                first = time.perf_counter() - t0
    return first, time.perf_counter() - t0


def main() -> None:
    with tempfile.TemporaryDirectory() as state:
        settings = BenchPoolSettings(model=str(MODEL), port=free_port(), n_ctx=4096, state_dir=Path(state))
        pool = LocalPool(settings, workers=1, threads=2, say=lambda _: None, inherit_settings=False, worker_env={})
        try:
            url, name = pool.start().url, MODEL.name.removesuffix(".gguf")
            _warm_up([url], name)
            with httpx.Client(timeout=60) as client:
                runs = [one(client, url, name, i) for i in range(25)][1:]
            ttft, total = (statistics.median(x) * 1000 for x in zip(*runs, strict=True))
            print(f"{tree.name}: ttft p50 {ttft:.1f} ms, total p50 {total:.1f} ms")
        finally:
            pool.stop()


if __name__ == "__main__":
    main()
