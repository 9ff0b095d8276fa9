"""Time to first token and to the end of a short answer at one client, through one default worker (SmolLM2, 2 threads).

25 streamed requests of 16 greedy tokens behind one 1,500-token system prompt (the first
evaluates it, the rest restore it: medians over those 24), with the code of the tree named by ``TREE``:

    TREE=$PWD PYTHONPATH=$PWD python docs/bench/round-writes-2026-12-07/ttft_ab.py
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
tree = Path(os.environ.get("TREE", ROOT))
sys.path.insert(0, str(tree))

import httpx  # noqa: E402

sys.path.insert(0, str(ROOT / "docs" / "bench" / "c1-2026-12-06"))
sys.path.insert(0, str(ROOT / "docs" / "bench" / "stream-entries-2026-12-07"))
from cpu_threads import warm_pool  # noqa: E402

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
    with warm_pool() as (_, url, name), httpx.Client(timeout=60) as client:
        runs = [one(client, url, name, i) for i in range(25)][1:]
    ttft, total = (statistics.median(x) * 1000 for x in zip(*runs, strict=True))
    print(f"{tree.name}: ttft p50 {ttft:.1f} ms, total p50 {total:.1f} ms")


if __name__ == "__main__":
    main()
