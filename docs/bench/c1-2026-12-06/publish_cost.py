"""What publishing costs the worker: the copy of a sequence's whole state, and cutting the new chunks from it.

For prompts of 600, 2,100 and 4,000 random tokens: the state read
(``worker.engine.llama_state.read_ctx_state`` into a reused buffer, as `worker.cache.publisher.Publisher.buffer`
gives the engine), median of 5, and the CPU of cutting 1, 2 and 8 chunks of 256 tokens
and the tail past the last full chunk from it (``worker.cache.kvchunks.cut_state`` / ``cut_cells``, the publisher
thread's work), median of 7.

    python docs/bench/c1-2026-12-06/publish_cost.py MODEL.gguf
"""

import statistics
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from worker.cache.kvchunks import cut_cells, cut_state  # noqa: E402
from worker.engine.llama_state import read_ctx_state  # noqa: E402

C = 256


def median_ms(fn, n: int, clock=time.perf_counter) -> float:
    times = []
    for _ in range(n):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times) * 1000


def one(llm, n: int, buf: bytearray, rng) -> str:
    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
    llm.eval([int(t) for t in rng.integers(3, min(40000, llm.n_vocab()), n)])
    read_ms = median_ms(lambda: read_ctx_state(llm.ctx, 0, lambda size: buf), 5)
    state = bytes(read_ctx_state(llm.ctx, 0))
    full = n // C
    cuts = {k: median_ms(lambda k=k: cut_state(state, C, full - k, full), 7, time.process_time) for k in (1, 2, 8) if k <= full}
    tail = median_ms(lambda: cut_cells(state, full * C, n), 7, time.process_time)
    listed = ", ".join(f"{k} chunk{'s' if k > 1 else ''} {ms:.1f} ms" for k, ms in cuts.items())
    return (
        f"{n} tokens: state {len(state) / 1e6:.1f} MB, read {read_ms:.1f} ms; cut CPU {listed}, the {n - full * C}-token tail {tail:.1f} ms"
    )


def main() -> None:
    llm = llama_cpp.Llama(sys.argv[1], n_ctx=4096, n_threads=2, n_threads_batch=2, verbose=False)
    rng = np.random.default_rng(0)
    buf = bytearray(256 << 20)
    for n in (600, 2100, 4000):
        print(one(llm, n, buf, rng), flush=True)


if __name__ == "__main__":
    main()
