"""One-token decode speed after a prompt: PYTHONPATH=$PWD .kvpool/venv/bin/python docs/bench/builds/decode_after.py PROMPT_TOKENS (LLAMA_CPP_LIB_PATH picks a build)."""

import json
import os
import sys
import time

os.environ.setdefault("GOMP_SPINCOUNT", "1000")
import numpy as np

from worker.engine.context import open_llama
from worker.engine.decoding import DecodeMode, decode_step
from worker.engine.llama_state import evaluate_prompt

n_seq_prompt = int(sys.argv[1])
llm = open_llama(".kvpool/models/SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=2048, n_threads=2, n_threads_batch=2, flash_attn=False)
rng = np.random.default_rng(0)
prompt = [int(t) for t in rng.integers(3, llm.n_vocab(), n_seq_prompt)]
t = time.perf_counter()
evaluate_prompt(llm, prompt, 0)
pr = n_seq_prompt / (time.perf_counter() - t)
rates = []
for _ in range(3):
    llm.n_tokens = n_seq_prompt
    steps = [int(t) for t in rng.integers(3, llm.n_vocab(), 64)]
    t = time.perf_counter()
    for tok in steps:
        decode_step(llm, tok, DecodeMode.SINGLE)
    rates.append(64 / (time.perf_counter() - t))
print(json.dumps({"prompt": round(pr, 1), "decode": round(sorted(rates)[1], 1)}))
