#!/usr/bin/env bash
# Build the llama-cpp-python wheel kvpool runs on, once per build recipe.
#
#   bash deploy/llama-wheel.sh DIR [SHARED_DIR]   # prints the path of the wheel
#
# The recipe is the version pinned in pyproject.toml ($LLAMA_CPP_PYTHON_VERSION where the
# Dockerfile builds without it), the patches in deploy/patches/
# (applied in name order to its source distribution) and $CMAKE_ARGS. Its hash names a
# folder, DIR/<recipe>/, that holds the wheel: a second run with the same recipe reuses it
# (or copies it from SHARED_DIR/<recipe>/, a cache for other clones), and a change of the
# version, a patch or a flag builds a new one instead of reusing a stale wheel. pip's own
# cache knows neither patches nor CMAKE_ARGS, hence --no-cache-dir.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:?usage: llama-wheel.sh DIR [SHARED_DIR]}
shared=${2:-}
version=${LLAMA_CPP_PYTHON_VERSION:-$(sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' "$root/pyproject.toml")}
python=${PYTHON:-python3}
cmake_args=${CMAKE_ARGS:-}

recipe=$({ echo "llama-cpp-python==$version"; echo "CMAKE_ARGS=$cmake_args"; cat "$root"/deploy/patches/*.patch; } | sha256sum | cut -c1-16)
wheel_in() { ls "$1/$recipe"/llama_cpp_python-"$version"-*.whl 2>/dev/null | head -n1; }

if [ -n "$(wheel_in "$dir")" ]; then
    wheel_in "$dir"
    exit 0
fi
mkdir -p "$dir/$recipe"
if [ -n "$shared" ] && [ -n "$(wheel_in "$shared")" ]; then
    cp "$(wheel_in "$shared")" "$dir/$recipe/"
    wheel_in "$dir"
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "[llama-wheel] building llama-cpp-python $version, recipe $recipe (compiles llama.cpp; minutes)" >&2
"$python" -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version"
for patch in "$root"/deploy/patches/*.patch; do
    # git apply outside any repository (the temporary folder) applies to the folder it runs in
    (cd "$src" && git apply -p1 --whitespace=nowarn "$patch")
done
CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "$python" -m pip wheel -q --no-cache-dir --no-deps -w "$dir/$recipe" "$src"
if [ -n "$shared" ]; then
    mkdir -p "$shared/$recipe" && cp "$(wheel_in "$dir")" "$shared/$recipe/" || true
fi
wheel_in "$dir"
