"""Prompt and decode speed of one llama.cpp build (``LLAMA_CPP_LIB_PATH``), and which decode modes are exact on it.

    PYTHONPATH=$PWD .kvpool/venv/bin/python docs/bench/builds/measure.py MODEL.gguf LABEL [N_PROMPT] [STEPS]

Prints one JSON line: the mode the start-up check picks, whether `single` and `pair`
keep a cold evaluation's bits on other random tokens, and the median of 3 runs of
decode tokens/s per mode (a random N_PROMPT-token prompt, then STEPS steps) and of
prompt tokens/s; every run is kept in ``runs``.
"""

import json
import os
import statistics
import sys
import time

os.environ.setdefault("GOMP_SPINCOUNT", "1000")  # as a worker sets it (worker.cpus.quiet_openmp)

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402

from worker.engine.context import open_llama  # noqa: E402
from worker.engine.decoding import DecodeMode, choose_mode, decode_step, decoded_logits  # noqa: E402
from worker.engine.llama_state import evaluate_prompt  # noqa: E402


def main(model: str, label: str, n_prompt: int, steps: int) -> dict:
    llm = open_llama(model, flash_attn=False, n_ctx=4096, n_threads=2, n_threads_batch=2)
    mode, _ = choose_mode(llm, "auto")
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, llm.n_vocab(), n_prompt)]

    def exact(m: DecodeMode) -> bool:
        p = [int(t) for t in rng.integers(3, llm.n_vocab(), 90)]
        a = [int(t) for t in rng.integers(3, llm.n_vocab(), 12)]
        return bool(np.array_equal(decoded_logits(llm, p, a, m), decoded_logits(llm, p, a, None)))

    def decode(m: DecodeMode) -> float:
        llm.reset()
        evaluate_prompt(llm, prompt, 0)
        toks = [int(t) for t in rng.integers(3, llm.n_vocab(), steps)]
        t = time.perf_counter()
        for tok in toks:
            decode_step(llm, tok, m)
        return steps / (time.perf_counter() - t)

    def prompt_rate() -> float:
        llm.reset()
        t = time.perf_counter()
        evaluate_prompt(llm, prompt, 0)
        return len(prompt) / (time.perf_counter() - t)

    ex = {"single": exact(DecodeMode.SINGLE), "pair": exact(DecodeMode.PAIR)}
    runs = [(decode(DecodeMode.SINGLE), decode(DecodeMode.PAIR), prompt_rate()) for _ in range(3)]
    single, pair, rate = (round(statistics.median(x), 1) for x in zip(*runs, strict=True))
    info = llama_cpp.llama_print_system_info().decode().strip()
    return {
        "build": label,
        "model": os.path.basename(model),
        "n_prompt": n_prompt,
        "chosen": str(mode),
        "exact": ex,
        "single_tps": single,
        "pair_tps": pair,
        "prompt_tps": rate,
        "runs": runs,
        "system_info": info,
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(args[0], args[1], int(args[2]) if len(args) > 2 else 700, int(args[3]) if len(args) > 3 else 64)))
