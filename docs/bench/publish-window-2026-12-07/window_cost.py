"""What a job's copy for publishing costs, the whole sequence against the cells of the chunks the store lacks.

For prompts of 600, 2,100 and 4,000 random tokens, the copy the engine makes before handing a
state to the publisher (``worker.engine.llama_state.read_ctx_state`` into a reused buffer, as
`worker.cache.publisher.Publisher.buffer` gives it): every cell (``start=0``, what a build without
deploy/patches/state-window.patch copies), against the cells from the last full chunk but one
(``start=(n // 256 - 1) * 256``: a turn that added a chunk and a tail, as a chat's next turn
does). Rounds interleave the two; median of 9 each.

    python docs/bench/publish-window-2026-12-07/window_cost.py MODEL.gguf
"""

import statistics
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from worker.engine.llama_state import read_ctx_state  # noqa: E402

C = 256


def main() -> None:
    llm = llama_cpp.Llama(sys.argv[1], n_ctx=4096, n_threads=2, n_threads_batch=2, flash_attn=True, verbose=False)
    rng = np.random.default_rng(0)
    buf = bytearray(512 << 20)
    for n in (600, 2100, 4000):
        llm.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
        llm.eval([int(t) for t in rng.integers(3, min(40000, llm.n_vocab()), n)])
        start = (n // C - 1) * C
        times: dict[int, list[float]] = {0: [], start: []}
        sizes = {}
        for _ in range(9):
            for s in times:
                t = time.perf_counter()
                sizes[s] = len(read_ctx_state(llm.ctx, 0, lambda size: buf, s))
                times[s].append(time.perf_counter() - t)
        whole, window = (statistics.median(times[s]) * 1000 for s in (0, start))
        print(
            f"{n} tokens: every cell {sizes[0] / 1e6:.1f} MB in {whole:.2f} ms; "
            f"from position {start} ({n - start} cells) {sizes[start] / 1e6:.1f} MB in {window:.2f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
