"""One-sequence decoding speed by which thread computes, and after which other thread ran llama.cpp's OpenMP regions.

    PYTHONPATH=$PWD .kvpool/venv/bin/python docs/bench/libgomp-2026-12-03/threads.py CASE

CASE is one of
  main        the main thread decodes; no other thread ever computed
  fresh       a new thread decodes; no other thread ever computed
  after-main  the main thread decodes a little first (as start-up checks do), then a new thread decodes
Each run prints one JSON line: the case, the OpenMP variables in effect, tokens/s over 96
one-token steps after a 48-token prompt (SmolLM2-135M Q4_1, 2 threads), and libgomp's
thread count as /proc shows it. Run each case in a process of its own, under each environment.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

import llama_cpp

MODEL = ".kvpool/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def decode(llm: llama_cpp.Llama, steps: int) -> float:
    llm.reset()
    llm.eval(list(range(100, 148)))
    t0 = time.perf_counter()
    for i in range(steps):
        llm.eval([200 + i])
    return steps / (time.perf_counter() - t0)


def main(case: str) -> None:
    llm = llama_cpp.Llama(MODEL, n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False)
    out: list[float] = []
    if case == "main":
        out.append(decode(llm, 96))
    else:
        if case == "after-main":
            decode(llm, 8)
        t = threading.Thread(target=lambda: out.append(decode(llm, 96)))
        t.start()
        t.join()
    threads = len(os.listdir(f"/proc/{os.getpid()}/task"))
    env = {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ}
    print(json.dumps({"case": case, "env": env, "tokens_per_s": round(out[0], 1), "threads": threads}), flush=True)


if __name__ == "__main__":
    assert Path(MODEL).exists(), MODEL
    main(sys.argv[1])
