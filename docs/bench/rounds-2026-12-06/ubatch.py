"""Time llama_decode of one-token steps by which sequences hold them (multi-stream KV: split_equal(sequential))."""

import statistics
import sys
import time

import llama_cpp
import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from batch import fill, new_batch  # noqa: E402

from worker.engine.context import open_llama

model, n_threads = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
llm = open_llama(model, flash_attn=False, n_ctx=2048, n_batch=512, n_threads=n_threads, n_threads_batch=n_threads, n_seq=4)
ctx = llm.ctx
mem = llama_cpp.llama_get_memory(ctx)
b = new_batch()
rng = np.random.default_rng(0)
NP = int(sys.argv[3]) if len(sys.argv) > 3 else 1000


def decode(items):  # items: (seq, tokens, pos0)
    fill(b, items)
    t0 = time.perf_counter()
    rc = llama_cpp.llama_decode(ctx, b)
    dt = time.perf_counter() - t0
    assert rc == 0, rc
    return dt


for s in range(4):
    toks = rng.integers(100, 20000, NP).tolist()
    for lo in range(0, NP, 500):
        decode([(s, toks[lo : lo + 500], lo)])


def steps(seqs, extra=None, rm=()):
    items = [(s, [int(rng.integers(100, 20000))], NP) for s in seqs]
    if extra:
        items.append(extra)
    dt = decode(items)
    for s in seqs:
        llama_cpp.llama_memory_seq_rm(mem, s, NP, -1)
    if extra:
        llama_cpp.llama_memory_seq_rm(mem, extra[0], extra[2], -1)
    return dt


cases = {
    "{0}": lambda: steps([0]),
    "{0,1}": lambda: steps([0, 1]),
    "{0,2}": lambda: steps([0, 2]),
    "{0,1,2} (1 a filler)": lambda: steps([0, 1, 2]),
    "{0,3}": lambda: steps([0, 3]),
    "{0,1,2,3}": lambda: steps([0, 1, 2, 3]),
    "{1,3}": lambda: steps([1, 3]),
    "steps {0,1,2} + prompt 128 of 3, one call": lambda: steps([0, 1, 2], (3, rng.integers(100, 20000, 128).tolist(), NP)),
    "steps {0,1,2}, then prompt 128 of 3": lambda: steps([0, 1, 2]) + steps([], (3, rng.integers(100, 20000, 128).tolist(), NP)),
    "prompt 128 of 3 alone": lambda: steps([], (3, rng.integers(100, 20000, 128).tolist(), NP)),
}
res = {k: [] for k in cases}
for _r in range(int(sys.argv[4]) if len(sys.argv) > 4 else 15):
    for k, f in cases.items():
        res[k].append(f())
for k, v in res.items():
    print(f"{k:45s} median {statistics.median(v) * 1000:8.2f} ms  (min {min(v) * 1000:.2f})")
