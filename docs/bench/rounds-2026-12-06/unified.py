"""Are a sequence's logits in a unified KV cache (kv_unified, sequences' cells interleaved) the cold bits?"""

import contextlib
import sys

import llama_cpp
import llama_cpp._internals as li
import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from batch import fill, new_batch  # noqa: E402

from worker.engine.context import open_llama

model = sys.argv[1]


def ctx(n_seq, unified):
    llm = open_llama(model, flash_attn=False, n_ctx=1024, n_batch=512, n_threads=2, n_threads_batch=2, n_seq=1)
    p = llm.context_params
    p.n_seq_max, p.kv_unified, p.n_ctx = n_seq, unified, 1024 * n_seq
    llm._ctx.close()
    llm._ctx = llm._stack.enter_context(contextlib.closing(li.LlamaContext(model=llm._model, params=p, verbose=False)))
    return llm


b = new_batch()


def decode(llm, items):
    i = fill(b, items)
    assert llama_cpp.llama_decode(llm.ctx, b) == 0
    nv = llm.n_vocab()
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, i - 1), shape=(nv,)).copy()


rng = np.random.default_rng(1)
A = rng.integers(100, 20000, 200).tolist()
B = rng.integers(100, 20000, 200).tolist()
cold = ctx(1, False)
for lo in range(0, 200, 20):
    la = decode(cold, [(0, A[lo : lo + 20], lo)])
for unified in (False, True):
    llm = ctx(2, unified)
    for lo in range(0, 200, 20):
        decode(llm, [(1, B[lo : lo + 20], lo)])
        l0 = decode(llm, [(0, A[lo : lo + 20], lo)])
    print(
        f"kv_unified={unified}: seq 0's last logits {'identical to' if np.array_equal(l0, la) else 'DIFFER from'} cold (max |diff| {np.abs(l0 - la).max():.3g})"
    )
