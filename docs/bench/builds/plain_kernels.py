"""Decode mode and speed of a model with llama.cpp's weight repacking on or off.

    PYTHONPATH=$PWD .kvpool/venv/bin/python docs/bench/builds/plain_kernels.py MODEL.gguf repack
    GGML_CPU_TILED_MM=0 PYTHONPATH=$PWD .kvpool/venv/bin/python docs/bench/builds/plain_kernels.py MODEL.gguf norepack

``norepack`` loads the weights without llama.cpp's extra buffer types
(``use_extra_bufts = false``, which llama-cpp-python's ``Llama`` does not expose, so its
default model parameters are replaced for this process); ``GGML_CPU_TILED_MM=0`` turns off
the tiled kernels of k-quants. Prints one JSON line: the mode the start-up check picks,
then the median of 3 runs of prompt tokens/s (600 random tokens) and one-token decode
tokens/s (64 steps) after it.
"""

import json
import os
import sys

os.environ.setdefault("GOMP_SPINCOUNT", "1000")  # as a worker sets it

import llama_cpp  # noqa: E402
import llama_cpp.llama as L  # noqa: E402

orig = llama_cpp.llama_model_default_params


def noextra() -> llama_cpp.llama_model_params:
    p = orig()
    p.use_extra_bufts = False
    return p


if sys.argv[2] == "norepack":
    L.llama_cpp.llama_model_default_params = noextra
from layouts import speeds  # noqa: E402  (this folder: run as a script)

from worker.engine.context import open_llama  # noqa: E402
from worker.engine.decoding import choose_mode  # noqa: E402

m = sys.argv[1]
llm = open_llama(m, n_ctx=2048, n_threads=2, n_threads_batch=2, flash_attn=False)
mode, _ = choose_mode(llm, "auto")
out = {"model": os.path.basename(m), "cfg": sys.argv[2], "tiled": os.environ.get("GGML_CPU_TILED_MM", "1"), "mode": str(mode)}
out.update(speeds(llm, (600,)))
print(json.dumps(out))
