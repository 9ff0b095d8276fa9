"""Where one client's decode time goes, inside the worker process: ms per generated token, each case a process of its own.

A 300-token random prompt, then 256 greedy one-token steps, 2 threads,
``GOMP_SPINCOUNT=1000`` as a worker sets it:

* ``plain-fa0`` / ``plain-fa1``: llama-cpp-python's ``Llama`` with flash attention off / on
  (llama-server's default is on), ``llama_decode`` and an argmax in a tight loop;
* ``context``: the worker's context (`worker.engine.context.Context`, P = 1 or 4), the same tight
  loop run as one task of the engine loop (the thread that owns the context);
* ``loop``: the same context, each step submitted by another thread through the loop
  (`worker.engine.decoding.decode_step`), as a job does.

    python docs/bench/c1-2026-12-06/decode_split.py MODEL.gguf [ROUNDS]
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROMPT, STEPS = 300, 256


def tight(llama_cpp, np, llm, pos):
    batch = llama_cpp.llama_batch_init(1, 0, 1)
    tok, t = 100, time.perf_counter()
    for _ in range(STEPS):
        batch.n_tokens = 1
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = tok, pos, 1, 1
        batch.seq_id[0][0] = 0
        llama_cpp.llama_decode(llm.ctx, batch)
        tok = int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, 0), shape=(llm.n_vocab(),)).argmax())
        pos += 1
    return time.perf_counter() - t


def case(model, name, parallel):
    sys.path.insert(0, str(ROOT))
    import llama_cpp
    import numpy as np

    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 40000, PROMPT)]
    if name.startswith("plain"):
        llm = llama_cpp.Llama(model, n_ctx=4096, n_threads=2, n_threads_batch=2, flash_attn=name.endswith("1"), verbose=False)
        llm.eval(prompt)
        return tight(llama_cpp, np, llm, PROMPT)
    from worker.engine.context import Context
    from worker.engine.decoding import choose_mode, decode_step
    from worker.engine.llama_state import evaluate_prompt, last_logits
    from worker.settings import WorkerSettings

    context = Context(WorkerSettings(model=model, parallel=parallel, n_ctx=4096, n_threads=2), Path(model))
    try:
        view = context.sequence(0)
        mode, _ = choose_mode(view, "auto")
        evaluate_prompt(view, prompt, 0)
        if name == "context":
            return context.loop.run(0, lambda llm: tight(llama_cpp, np, llm, PROMPT))
        t, tok = time.perf_counter(), int(np.argmax(last_logits(view)))
        for _ in range(STEPS):
            decode_step(view, tok, mode)
            tok = int(np.argmax(last_logits(view)))
        return time.perf_counter() - t
    finally:
        context.close()


if __name__ == "__main__":
    if sys.argv[1] == "--case":
        os.environ.setdefault("GOMP_SPINCOUNT", "1000")
        wall = case(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        print(json.dumps({"case": sys.argv[3], "P": int(sys.argv[4]), "ms_per_token": round(wall / STEPS * 1000, 2)}), flush=True)
        sys.exit(0)
    model, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
    for _ in range(rounds):
        for name, p in (("plain-fa0", 1), ("plain-fa1", 1), ("context", 1), ("context", 4), ("loop", 1), ("loop", 4)):
            env = {**os.environ, "GOMP_SPINCOUNT": "1000"}
            out = subprocess.run([sys.executable, __file__, "--case", model, name, str(p)], capture_output=True, text=True, env=env)
            line = [x for x in out.stdout.splitlines() if x.startswith("{")]
            print(line[-1] if line else f"{name} P={p} failed: {out.stderr[-300:]}", flush=True)
