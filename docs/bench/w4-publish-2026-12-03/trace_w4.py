"""W4 at concurrency 1, request by request: llama-server 1 slot, kvpool 1 worker, and kvpool 1 worker with publishing off.

    PYTHONPATH=$PWD .kvpool/venv/bin/python docs/bench/w4-publish-2026-12-03/trace_w4.py OUT_DIR [ROUNDS] [--with-llama-server]

Sends `kvpool bench-peers`' W4 (8 distinct chat prompts of 540-850 tokens, 32 tokens each,
streamed) one after another to each system in turn, ROUNDS times, and prints one JSON line
per request (time to the first content token, time to the end of the stream) and one
``SUM`` line per system and round. The systems are started as `bench-peers` starts them.
"""

import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from gateway.pool.bench.peer_workloads import workloads
from gateway.pool.bench.peers import BenchPoolSettings, llama_servers
from gateway.pool.procs import free_port
from gateway.pool.up import LocalPool

MODEL = Path(".kvpool/models/SmolLM2-135M-Instruct.Q4_1.gguf")
SERVER = Path(".kvpool/llama-server/bin/llama-server")
N_CTX = 4096


def run(url: str, bodies: tuple[str, ...], label: str) -> list[dict]:
    rows = []
    with httpx.Client(timeout=120) as c:
        for i, body in enumerate(bodies):
            t0, first = time.perf_counter(), None
            with c.stream("POST", url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {") and _content(json.loads(line[6:])):
                        first = time.perf_counter() - t0
            assert first is not None, f"{label}: no content in the answer to request {i}"
            rows.append({"system": label, "request": i, "first_token_s": round(first, 4), "total_s": round(time.perf_counter() - t0, 4)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _content(chunk: dict) -> str:
    choices = chunk.get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


@contextmanager
def kvpool(out: Path, publish: bool) -> Iterator[str]:
    settings = BenchPoolSettings(model=str(MODEL), port=free_port(), n_ctx=N_CTX, state_dir=Path(tempfile.mkdtemp(dir=out)))
    env = {"KVPOOL_PARALLEL": "1", "KVPOOL_PUBLISH": "true" if publish else "false"}
    pool = LocalPool(settings, workers=1, threads=2, say=lambda _: None, inherit_settings=False, worker_env=env)
    try:
        yield pool.start().url
    finally:
        pool.stop()


def main(out: Path, rounds: int, systems: tuple[str, ...]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    bodies = workloads(Path("."), MODEL.name.removesuffix(".gguf"), ("W4",))[0].bodies
    for rnd in range(rounds):
        for label in systems:
            if label.startswith("llama-server"):
                with llama_servers(SERVER, MODEL, count=1, threads=2, slots=1, n_ctx=N_CTX, logs=out) as urls:
                    rows = run(urls[0], bodies, label)
            else:
                with kvpool(out, publish="PUBLISH" not in label) as url:
                    rows = run(url, bodies, label)
            first = sum(r["first_token_s"] for r in rows)
            after = sum(r["total_s"] - r["first_token_s"] for r in rows)
            print(f"SUM round {rnd + 1} | {label} | first tokens {first:.2f} s | first token to end {after:.2f} s", flush=True)


if __name__ == "__main__":
    peer = ("llama-server 1 slot",) if "--with-llama-server" in sys.argv else ()
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3, (*peer, "kvpool 1w", "kvpool 1w, KVPOOL_PUBLISH=false"))
