"""Gemma 3 270M: checkpoints restored after 544..2,016 tokens, with swa_full on (argv[2] = 1) or off (0): cold bits or not."""

import sys

import llama_cpp
import numpy as np

from worker.cache.checkpoints import restore_checkpoint
from worker.engine.llama_state import evaluate_prompt, last_logits, read_seq_state
from worker.startup.selfcheck import check_checkpoint

full = sys.argv[2] == "1"
llm = llama_cpp.Llama(sys.argv[1], n_ctx=4096, n_threads=2, verbose=False, flash_attn=False, swa_full=full)
print(check_checkpoint(llm))
rng = np.random.default_rng(3)
toks = [int(t) for t in rng.integers(3, llm.n_vocab(), 2400)]
ok = []
for k in [544, 800, 1056, 1600, 2016]:
    llm.reset()
    evaluate_prompt(llm, toks[: k + 9], 0)
    a = last_logits(llm)
    llm.reset()
    evaluate_prompt(llm, toks[:k], 0)
    st = read_seq_state(llm)
    llm.reset()
    restore_checkpoint(llm, st, toks[:k], 512)
    evaluate_prompt(llm, toks[: k + 9], k)
    b = last_logits(llm)
    ok.append((k, bool(np.array_equal(a, b))))
print(ok)
