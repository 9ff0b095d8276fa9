"""A lone token's decode of an f16 model on several llama.cpp builds: exact or not, and ms per token.

A build is the folder of its shared libraries (``LLAMA_CPP_LIB_PATH``; build one from the
sdist with ``deploy/patches`` applied, or unzip a wheel of ``deploy/llama-wheel.sh``); an
empty folder means the venv's. Per case, a process of its own, 2 threads, flash attention:
exact means a 400-token random prompt evaluated as 399 + 1 and as 370 + 30 single tokens
leaves the same last logits and the same sequence state, byte for byte, as one batch of 400;
decode is the median ms of STEPS one-token steps after a 300-token prompt.

    python docs/bench/decode-f16-2026-12-07/probe.py MODEL.gguf STEPS ROUNDS NAME=LIBDIR ...
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def case(model, steps):
    import llama_cpp
    import numpy as np

    from worker.engine.llama_state import read_ctx_state

    llm = llama_cpp.Llama(model, n_ctx=2048, n_threads=2, n_threads_batch=2, flash_attn=True, verbose=False, n_batch=512, n_ubatch=512)
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, min(40000, llm.n_vocab()), 400)]

    def evaluated(cuts: list[int]) -> bytes:
        """The last logits and the sequence state after the prompt, evaluated in pieces ending at ``cuts``."""
        llm.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
        for a, b in zip([0, *cuts], cuts, strict=False):
            llm.eval(prompt[a:b])
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        return logits.tobytes() + bytes(read_ctx_state(llm.ctx, 0))

    cold = evaluated([400])
    exact = {"399+1": evaluated([399, 400]) == cold, "370+1x30": evaluated(list(range(370, 401))) == cold}
    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
    llm.eval(prompt[:300])
    batch = llama_cpp.llama_batch_init(1, 0, 1)
    batch.n_tokens, batch.n_seq_id[0], batch.logits[0], batch.seq_id[0][0] = 1, 1, 1, 0
    times, tok = [], 100
    for pos in range(300, 300 + steps):  # greedy one-token steps, each timed alone
        batch.token[0], batch.pos[0] = tok, pos
        t = time.perf_counter()
        llama_cpp.llama_decode(llm.ctx, batch)
        times.append(time.perf_counter() - t)
        tok = int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).argmax())
    times.sort()
    return {
        "exact": exact,
        "decode_ms_median": round(1000 * times[len(times) // 2], 2),
        "decode_ms_mean": round(1000 * sum(times) / len(times), 2),
    }


if __name__ == "__main__":
    if sys.argv[1] == "--case":
        print(json.dumps(case(sys.argv[2], int(sys.argv[3]))), flush=True)
        sys.exit(0)
    model, steps, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    builds = dict(a.split("=", 1) for a in sys.argv[4:])
    for r in range(rounds):
        for b, lib in builds.items():
            env = {**os.environ, "GOMP_SPINCOUNT": "1000"}
            if lib:
                env["LLAMA_CPP_LIB_PATH"] = lib
                env["LD_LIBRARY_PATH"] = lib
            out = subprocess.run([sys.executable, __file__, "--case", model, steps], capture_output=True, text=True, env=env)
            lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
            print(json.dumps({"round": r, "build": b, **(json.loads(lines[-1]) if lines else {"failed": out.stderr[-400:]})}), flush=True)
