"""Flash attention on and off, on two llama.cpp builds: exactness, decode and prompt speed. Each case a process of its own.

A build is the folder of its ``libllama.so`` (``LLAMA_CPP_LIB_PATH``; unzip a wheel of
``deploy/llama-wheel.sh``); "installed" is the venv's. Per case, 2 threads,
``GOMP_SPINCOUNT=1000`` as a worker sets it:

* exact: a 700-token random prompt evaluated in one batch (the cold run) against 600 + 100
  single tokens, 699 + 1, 7 x 100 and 20 single tokens then the rest: are the last logits and
  the whole sequence state the same bytes?
* decode: ms per token, 256 greedy one-token steps after a 300-token prompt;
* prompt: tokens/s of a 600- and a 2,000-token prompt in batches of 512.

    python docs/bench/flash-attention-2026-12-06/fa.py MODEL.gguf [ROUNDS] [BUILD=LIBDIR ...]
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def case(model: str, fa: bool) -> dict:
    sys.path.insert(0, str(ROOT))
    import llama_cpp
    import numpy as np

    from worker.engine.llama_state import read_ctx_state

    llm = llama_cpp.Llama(model, n_ctx=4096, n_threads=2, n_threads_batch=2, flash_attn=fa, verbose=False, n_batch=512, n_ubatch=512)
    rng = np.random.default_rng(1)
    vocab = min(40000, llm.n_vocab())
    mem = llama_cpp.llama_get_memory(llm.ctx)

    def fresh():
        llm.reset()
        llama_cpp.llama_memory_clear(mem, True)

    def last():
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()

    prompt = [int(t) for t in rng.integers(3, vocab, 700)]
    exact = {}
    cold = None
    for name, splits in {
        "700": [700],
        "600+1x100": [600] + [1] * 100,
        "699+1": [699, 1],
        "7x100": [100] * 7,
        "1x20+680": [1] * 20 + [680],
    }.items():
        fresh()
        i = 0
        for s in splits:
            llm.eval(prompt[i : i + s])
            i += s
        got = (last(), bytes(read_ctx_state(llm.ctx, 0)))
        if cold is None:
            cold = got
            continue
        exact[name] = {
            "logits": bool((got[0] == cold[0]).all()),
            "max_diff": float(abs(got[0] - cold[0]).max()),
            "state": got[1] == cold[1],
        }

    fresh()
    llm.eval(prompt[:300])
    batch = llama_cpp.llama_batch_init(1, 0, 1)
    pos, tok, t = 300, 100, time.perf_counter()
    for _ in range(256):
        batch.n_tokens = 1
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = tok, pos, 1, 1
        batch.seq_id[0][0] = 0
        llama_cpp.llama_decode(llm.ctx, batch)
        tok, pos = int(last().argmax()), pos + 1
    decode_ms = (time.perf_counter() - t) / 256 * 1000

    prompt_tok_s = {}
    for n in (600, 2000):
        fresh()
        tokens = [int(t) for t in rng.integers(3, vocab, n)]
        t = time.perf_counter()
        llm.eval(tokens)
        prompt_tok_s[n] = round(n / (time.perf_counter() - t), 1)
    return {"exact": exact, "decode_ms_per_token": round(decode_ms, 2), "prompt_tok_s": prompt_tok_s}


if __name__ == "__main__":
    if sys.argv[1] == "--case":
        print(json.dumps(case(sys.argv[2], sys.argv[3] == "1")), flush=True)
        sys.exit(0)
    model = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 2
    builds = dict(a.split("=", 1) for a in sys.argv[2:] if "=" in a) or {"installed": ""}
    for r in range(rounds):
        for build, lib in builds.items():
            for fa in (False, True):
                env = {**os.environ, "GOMP_SPINCOUNT": "1000"}
                if lib:
                    env["LLAMA_CPP_LIB_PATH"] = lib
                out = subprocess.run(
                    [sys.executable, __file__, "--case", model, "1" if fa else "0"], capture_output=True, text=True, env=env
                )
                lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
                res = json.loads(lines[-1]) if lines else {"failed": out.stderr[-300:]}
                print(json.dumps({"round": r, "build": build, "flash_attn": fa, **res}), flush=True)
