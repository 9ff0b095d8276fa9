"""A sibling's prefix copied through host memory (read its state, load it) against llama.cpp's stream copy, applied at once.

    .kvpool/venv/bin/python docs/bench/siblings/probe_cp.py MODEL TOKENS

Sequence 0 of a two-sequence context holds TOKENS + 30 tokens; sequence 1's stream is first
filled with other cells, then gets the first TOKENS by each way, evaluates 8 more, and its
logits are compared with a cold evaluation's ("nocopy": nothing copied, the check's control).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402

from worker.cache.siblings import copy_stream  # noqa: E402
from worker.engine.context import Context  # noqa: E402
from worker.engine.llama_state import clear_seq, evaluate_prompt, last_logits, read_ctx_state, write_ctx_state  # noqa: E402
from worker.engine.sequence import restream  # noqa: E402
from worker.settings import WorkerSettings  # noqa: E402


def main() -> None:
    model, n = sys.argv[1], int(sys.argv[2])
    ctx = Context(WorkerSettings(model=model, n_ctx=4096, parallel=2, n_threads=2, n_threads_batch=2), Path(model))
    a, b = ctx.sequence(0), ctx.sequence(1)
    rng = np.random.default_rng(0)
    toks = [int(t) for t in rng.integers(100, 20000, n + 40)]
    other = [int(t) for t in rng.integers(100, 20000, n + 8)]
    evaluate_prompt(a, toks[: n + 30], 0)  # the sibling holds the prefix and more
    clear_seq(b)
    evaluate_prompt(b, toks[: n + 8], 0)
    ref = last_logits(b)

    def via_state(llm: llama_cpp.Llama) -> None:
        write_ctx_state(llm.ctx, restream(read_ctx_state(llm.ctx, 0), 0, 1, 2), 1)

    def via_stream(llm: llama_cpp.Llama) -> None:
        assert copy_stream(llm, 0, 1)

    for name, fn in [("stream", via_stream), ("state", via_state), ("stream", via_stream), ("nocopy", lambda llm: None)]:
        clear_seq(b)
        evaluate_prompt(b, other, 0)  # b's stream now holds other cells where the prefix goes
        clear_seq(b)
        t0 = time.perf_counter()
        ctx.loop.run(1, fn)
        ctx.loop.run(1, lambda llm: llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), 1, n, -1))
        dt = time.perf_counter() - t0
        b.input_ids[:n] = toks[:n]
        b.n_tokens = n
        evaluate_prompt(b, toks[: n + 8], n)
        same = np.array_equal(last_logits(b), ref)
        print(f"tokens={n} {name}: copy {dt * 1000:.1f} ms, positions {b.positions()}, logits as cold: {same}", flush=True)
    ctx.close()


if __name__ == "__main__":
    main()
