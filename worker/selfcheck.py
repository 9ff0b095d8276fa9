"""The start-up check: does cut, rebuild and restore reproduce a cold evaluation on this model and layout?

A state blob carries no version, and llama.cpp loads a wrong assembly without a word.
So before it restores anything from the store, a worker proves the round trip on its
own model and context: evaluate a few chunks cold, cut the state, rebuild it, restore
it into the emptied sequence, evaluate the same suffix, and compare the logits.

The comparison also tells whether the layout is *exact*: a restored prefix plus a
short suffix gives the very bits of the cold evaluation. That holds where llama.cpp's
kernels do not depend on the batch's size (f16 without flash attention, q8_0 with it);
f16 with flash attention switches to a tiled kernel for larger batches and is close,
not exact. An inexact layout still restores, and says so in its metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worker.kvchunks import cut_state, join_state
from worker.llama_state import ContextCache, Llama, evaluate_prompt, last_logits, read_seq_state, restore_seq_state

CHECK_CHUNK = 16
CHECK_CHUNKS = 3
CHECK_SUFFIX = 5
ATOL = 0.05


@dataclass(frozen=True)
class SelfCheck:
    ok: bool
    """Restores may be used: same argmax, logits within `ATOL`."""
    exact: bool
    """The restored run gave bit-identical logits."""
    detail: str


def check_restore(llm: Llama, kv: ContextCache, seed: int = 0) -> SelfCheck:
    """Runs the round trip. Leaves the context empty."""
    n_prefix = CHECK_CHUNK * CHECK_CHUNKS
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(3, llm.n_vocab(), n_prefix + CHECK_SUFFIX)]
    try:
        llm.reset()
        evaluate_prompt(llm, tokens, 0)
        cold = last_logits(llm)
        payloads = cut_state(read_seq_state(llm), CHECK_CHUNK, 0, CHECK_CHUNKS)
        llm.reset()
        restore_seq_state(llm, join_state(payloads, v_trans=kv.v_trans), tokens[:n_prefix])
        evaluate_prompt(llm, tokens, n_prefix)
        warm = last_logits(llm)
    except Exception as e:  # any failure here means: do not restore
        return SelfCheck(False, False, f"{type(e).__name__}: {e}")
    finally:
        llm.reset()
    diff = float(np.max(np.abs(cold - warm)))
    same_argmax = int(cold.argmax()) == int(warm.argmax())
    ok = same_argmax and diff <= ATOL and bool(np.isfinite(warm).all())
    exact = ok and bool(np.array_equal(cold, warm))
    detail = (
        f"max |logit diff| {diff:.3g} (tolerance {ATOL}), argmax {'same' if same_argmax else 'differs'}, {'exact' if exact else 'inexact'}"
    )
    return SelfCheck(ok, exact, detail)
