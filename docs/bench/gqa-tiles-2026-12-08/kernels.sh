#!/usr/bin/env bash
# llama.cpp's own batched bench (llama-batched-bench) on builds that differ only in their patches.
#
#   bash kernels.sh build OUT PATCH...      # llama-batched-bench of llama-cpp-python's llama.cpp with PATCHes, to OUT
#   bash kernels.sh run ROUNDS NAME=BIN...  # ROUNDS interleaved rounds of each build, 2 threads, flash attention on
#
# Each run: SmolLM2-135M-Instruct Q4_1, a KV stream per sequence (-no-kvu, as kvpool's workers and
# llama-server -np 4 run), prompts of NPP tokens (256 and 2,048), then NTG generated tokens (128), at 1
# and 4 sequences; PPS=-pps evaluates the prompt once and copies it to the other sequences (shorter runs).
# The builds used here (2026-12-08): stock = deploy/patches/amx-off.patch alone (llama-server's recipe);
# before = every patch of deploy/patches at 6f0381f; after = every patch of deploy/patches now.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
MODEL=${MODEL:-.kvpool/models/SmolLM2-135M-Instruct.Q4_1.gguf}
case "${1:?build or run}" in
build)
    out=$2; shift 2
    work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
    python3 -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$VERSION"
    tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
    for patch in "$@"; do
        patch=$(realpath "$patch")  # before the cd below: relative to where this runs
        (cd "$work/llama_cpp_python-$VERSION" && git apply -p1 --whitespace=nowarn "$patch")
    done
    cmake -S "$work/llama_cpp_python-$VERSION/vendor/llama.cpp" -B "$work/build" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$work/build" --target llama-batched-bench -j"$(nproc)" >/dev/null
    cp "$work/build/bin/llama-batched-bench" "$out"
    ;;
run)
    rounds=$2; shift 2
    for r in $(seq "$rounds"); do
        for build in "$@"; do
            printf 'round %s %s:' "$r" "${build%%=*}"
            GOMP_SPINCOUNT=1000 "${build#*=}" -m "$MODEL" -c 20480 -b 2048 -ub 512 -npp "${NPP:-256,2048}" -ntg "${NTG:-128}" -npl 1,4 ${PPS:-} -fa on -t 2 -no-kvu 2>/dev/null |
                awk -F'|' '/^\| +[0-9]/ { gsub(/ /, ""); printf "  context %s x%s: %s tokens/s", $2, $4, $9 } END { print "" }'
        done
    done
    ;;
esac
