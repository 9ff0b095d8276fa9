"""One-sequence decode speed of the bench model (1.1B, f16 weights) by decode mode, on the build LLAMA_CPP_LIB_PATH names.

    PYTHONPATH=$PWD [LLAMA_CPP_LIB_PATH=DIR] .kvpool/venv/bin/python docs/bench/bench-model-2026-12-03/decode_modes.py LABEL

Evaluates a 48-token prompt, then decodes 24 tokens one step at a time in ``single`` mode
(one-token batches) and in ``pair`` mode (each token with its predecessor), on the main
thread with 2 threads and ``GOMP_SPINCOUNT=1000`` as a worker runs, and prints one JSON line:
tokens/s of each mode, and whether each mode's last logits equal a cold evaluation's bits.
"""

import json
import os
import sys
import time

os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import numpy as np  # noqa: E402

from worker.engine.context import open_llama  # noqa: E402
from worker.engine.decoding import DecodeMode, decode_step, decoded_logits  # noqa: E402
from worker.engine.llama_state import evaluate_prompt  # noqa: E402

MODEL = ".kvpool/models/kvpool-bench-s0.gguf"
STEPS = 24


def speed(llm, prompt: list[int], mode: DecodeMode) -> float:  # type: ignore[no-untyped-def]
    llm.reset()
    evaluate_prompt(llm, prompt, 0)
    t0 = time.perf_counter()
    for i in range(STEPS):
        decode_step(llm, 300 + i, mode)
    return STEPS / (time.perf_counter() - t0)


def main(label: str) -> None:
    llm = open_llama(MODEL, flash_attn=False, n_ctx=1024, n_threads=2)
    prompt = list(range(100, 148))
    answer = list(range(300, 306))
    cold = decoded_logits(llm, prompt, answer, None)
    row = {"build": label}
    for mode in (DecodeMode.SINGLE, DecodeMode.PAIR):
        row[f"{mode}_tokens_per_s"] = round(speed(llm, prompt, mode), 2)
        row[f"{mode}_exact"] = bool(np.array_equal(decoded_logits(llm, prompt, answer, mode), cold))
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
