#!/usr/bin/env bash
# Interleaved rounds of three llama.cpp builds of llama-cpp-python 0.3.36's vendored source,
# each loaded through LLAMA_CPP_LIB_PATH (the folder of its libllama.so and libggml*.so):
#   bash docs/bench/builds/rounds.sh MODEL.gguf OUT.jsonl ROUNDS DEFAULT_LIB NOLF_LIB SGEMM_SINGLE_LIB
# An empty DEFAULT_LIB uses the virtualenv's own library. Each line of OUT is one build's
# measure.py result (median of 3 runs; every run is kept in "runs").
set -euo pipefail
cd "$(dirname "$0")/../../.."
model=$1 out=$2 rounds=${3:-3}
declare -A libs=([default]=${4:-} [nolf]=${5:?} [sgs]=${6:?})
for _ in $(seq "$rounds"); do
    for build in default nolf sgs; do
        if [ -n "${libs[$build]}" ]; then export LLAMA_CPP_LIB_PATH=${libs[$build]}; else unset LLAMA_CPP_LIB_PATH; fi
        PYTHONPATH=$PWD .kvpool/venv/bin/python docs/bench/builds/measure.py "$model" "$build" 1000 64 >>"$out"
    done
done
