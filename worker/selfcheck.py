"""The start-up check: does cut, rebuild and restore reproduce a cold evaluation on this model and layout?

A state blob carries no version, and llama.cpp loads a wrong assembly without a word.
So before it restores anything from the store, a worker proves the round trip on its
own model and context: evaluate a few chunks cold, cut the state, rebuild it, restore
it into the emptied sequence, evaluate the same suffix, and compare the logits.
"""

from __future__ import annotations

import llama_cpp
import numpy as np

from worker.kvchunks import cut_state, join_state
from worker.llama_state import KvLayout, read_seq_state, restore_seq_state

CHECK_CHUNK = 16
CHECK_CHUNKS = 3
CHECK_SUFFIX = 5
ATOL = 0.05


def last_logits(llm: llama_cpp.Llama) -> np.ndarray:
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()


def check_restore(llm: llama_cpp.Llama, kv: KvLayout, seed: int = 0) -> tuple[bool, str]:
    """Returns (passed, what was seen). Leaves the context empty."""
    n_prefix = CHECK_CHUNK * CHECK_CHUNKS
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(3, llm.n_vocab(), n_prefix + CHECK_SUFFIX)]
    try:
        llm.reset()
        llm.eval(tokens)
        cold = last_logits(llm)
        payloads = cut_state(read_seq_state(llm), CHECK_CHUNK, 0, CHECK_CHUNKS)
        llm.reset()
        restore_seq_state(llm, join_state(payloads, v_trans=kv.v_trans), tokens[:n_prefix])
        llm.eval(tokens[n_prefix:])
        warm = last_logits(llm)
    except Exception as e:  # any failure here means: do not restore
        return False, f"{type(e).__name__}: {e}"
    finally:
        llm.reset()
    diff = float(np.max(np.abs(cold - warm)))
    same_argmax = int(cold.argmax()) == int(warm.argmax())
    ok = same_argmax and diff <= ATOL and np.isfinite(warm).all()
    return ok, f"max |logit diff| {diff:.3g} (tolerance {ATOL}), argmax {'same' if same_argmax else 'differs'}"
