"""Gemma 3 270M: a checkpoint restored after k tokens, 9 more evaluated, then a few decoded: cold bits at each step or not.

argv: model, prompt seed, comma-separated k. The restored window starts at k - 512.
"""

import sys

import llama_cpp
import numpy as np

from worker.cache.checkpoints import restore_checkpoint
from worker.engine.decoding import choose_mode, decode_step
from worker.engine.llama_state import evaluate_prompt, last_logits, read_seq_state

llm = llama_cpp.Llama(sys.argv[1], n_ctx=4096, n_threads=2, verbose=False, flash_attn=False)
mode, why = choose_mode(llm, "auto")
print("mode", mode, why)
SEED = int(sys.argv[2])
rng = np.random.default_rng(SEED)
toks = [int(t) for t in rng.integers(3, llm.n_vocab(), 1100)]


def run(k, n):
    """restore at k (or cold if k==0), evaluate to n, then decode 6 greedy tokens; logits per step"""
    llm.reset()
    if k:
        evaluate_prompt(llm, toks[:k], 0)
        st = read_seq_state(llm)
        llm.reset()
        restore_checkpoint(llm, st, toks[:k], 0)  # 0: no alignment refusal, to probe any shift
        evaluate_prompt(llm, toks[:n], k)
    else:
        evaluate_prompt(llm, toks[:n], 0)
    out = [last_logits(llm)]
    for _ in range(2):
        decode_step(llm, int(out[-1].argmax()), mode)
        out.append(last_logits(llm))
    return out


for k in [int(x) for x in sys.argv[3].split(",")]:
    n = k + 9
    a, b = run(0, n), run(k, n)
    print(k, "shift", k - 512, [bool(np.array_equal(x, y)) for x, y in zip(a, b)], flush=True)
