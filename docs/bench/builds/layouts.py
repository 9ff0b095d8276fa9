"""Decode and prompt speed of three KV layouts on one build, as the bench's peers run them.

    PYTHONPATH=$PWD .kvpool/venv/bin/python docs/bench/builds/layouts.py {f16|f16fa|q8fa}

``f16``: f16 K and V without flash attention (kvpool's default layout); ``f16fa``: f16
with flash attention (llama-server's default, ``-fa auto``); ``q8fa``: q8_0 K and V with
flash attention. Prints one JSON line: the decode mode the start-up check picks, and the
median of 3 runs of prompt tokens/s and then one-token decode tokens/s (64 steps) after
a random prompt of 40 and of 600 tokens. ``LLAMA_CPP_LIB_PATH`` picks another build.
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
from worker.engine.decoding import DecodeMode, choose_mode, decode_step  # noqa: E402
from worker.engine.llama_state import evaluate_prompt  # noqa: E402

MODEL = ".kvpool/models/SmolLM2-135M-Instruct.Q4_1.gguf"
LAYOUTS = {
    "f16": {"flash_attn": False},
    "f16fa": {"flash_attn": True},
    "q8fa": {"flash_attn": True, "type_k": llama_cpp.GGML_TYPE_Q8_0, "type_v": llama_cpp.GGML_TYPE_Q8_0},
}


def main(label: str) -> dict:
    llm = open_llama(MODEL, n_ctx=4096, n_threads=2, n_threads_batch=2, **LAYOUTS[label])
    mode, _ = choose_mode(llm, "auto")
    return {"layout": label, "mode": str(mode), **speeds(llm, (40, 600))}


def speeds(llm: llama_cpp.Llama, prompt_lengths: tuple[int, ...]) -> dict:
    """Per prompt length: the median of 3 runs of prompt tokens/s, then of 64 one-token steps' tokens/s."""
    rng = np.random.default_rng(0)
    out: dict = {}
    for n_prompt in prompt_lengths:
        prompt = [int(t) for t in rng.integers(3, llm.n_vocab(), n_prompt)]
        runs = []
        for _ in range(3):
            llm.reset()
            t = time.perf_counter()
            evaluate_prompt(llm, prompt, 0)
            rate = n_prompt / (time.perf_counter() - t)
            steps = [int(t) for t in rng.integers(3, llm.n_vocab(), 64)]
            t = time.perf_counter()
            for tok in steps:
                decode_step(llm, tok, DecodeMode.SINGLE)
            runs.append((64 / (time.perf_counter() - t), rate))
        out[f"decode@{n_prompt}"] = round(statistics.median(r[0] for r in runs), 1)
        out[f"prompt@{n_prompt}"] = round(statistics.median(r[1] for r in runs), 1)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
