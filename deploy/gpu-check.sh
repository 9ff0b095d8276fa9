#!/usr/bin/env bash
# Does kvpool's batched engine run, and stay exact, on this machine's GPU?
#
#   bash deploy/gpu-check.sh [MODEL.gguf]
#
# Builds llama-cpp-python (the pinned version) with CUDA into a virtualenv of its own
# (.kvpool/venv-cuda; the CPU one is left alone), installs kvpool into it, then runs
# `kvpool bench-decode` with every layer offloaded: decode tokens/s of one worker context
# at 1, 4 and 16 sequences, whether restore is exact (the start-up self-check), which
# decode mode the exactness check chose (settle: no exact decoding on this device), and how
# many sequences' answers are the tokens decoded alone. Needs nvcc (CUDA toolkit) and cmake;
# the build takes several minutes. The report goes to stdout and .kvpool/gpu-check.json.
set -euo pipefail

cd "$(dirname "$0")/.."
command -v nvcc >/dev/null || { echo "nvcc not found: install the CUDA toolkit (or put it on PATH)" >&2; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
VENV=${KVPOOL_CUDA_VENV:-.kvpool/venv-cuda}
WHEELS=.kvpool/wheels-cuda
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --upgrade pip
# The same recipe as setup.sh's (deploy/patches/ applied) with CUDA on: deploy/llama-wheel.sh
WHEEL=$(CMAKE_ARGS="-DGGML_CUDA=on" PYTHON="$VENV/bin/python" bash deploy/llama-wheel.sh "$WHEELS")
"$VENV/bin/pip" install --quiet --force-reinstall --no-deps "$WHEEL"
"$VENV/bin/pip" install --quiet -e ".[bench]"  # llama-cpp-python is satisfied by the CUDA wheel above
"$VENV/bin/python" -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"

MODEL=${1:-}
"$VENV/bin/kvpool" bench-decode ${MODEL:+--model "$MODEL"} --sequences 1,4,16 --tokens 64 --n-gpu-layers 999 --out .kvpool/gpu-check.json
