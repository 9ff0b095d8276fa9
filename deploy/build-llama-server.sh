#!/usr/bin/env bash
# Build llama.cpp's llama-server from the very llama.cpp that the pinned llama-cpp-python vendors,
# for side-by-side benchmarks (kvpool bench --llama-server PATH). Needs only the package index.
#
#   bash deploy/build-llama-server.sh            # -> .kvpool/llama-server/bin/llama-server
#
# Idempotent: an existing binary is kept (delete it after a change of deploy/patches/amx-off.patch). About 3 minutes on 2 cores.
set -euo pipefail

cd "$(dirname "$0")/.."
VERSION=$(sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' pyproject.toml)
OUT=${KVPOOL_LLAMA_SERVER_DIR:-.kvpool/llama-server}
BIN=$OUT/bin/llama-server
PY=${PYTHON:-.kvpool/venv/bin/python}
[ -x "$PY" ] || PY=python3

if [ -x "$BIN" ]; then
    echo "$BIN"
    exit 0
fi
command -v cmake >/dev/null || { echo "cmake is needed (apt-get install cmake)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$VERSION"
tar xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
# The AMX buffer type crashes at the first decode on some AMX machines (deploy/patches/amx-off.patch):
# the peer is built without it too, so it runs there, on the same kernels as the workers.
patch=$PWD/deploy/patches/amx-off.patch
(cd "$work/llama_cpp_python-$VERSION" && git apply -p1 --whitespace=nowarn "$patch")
cmake -S "$src" -B "$work/build" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/build" --target llama-server -j"$(nproc)" >/dev/null
mkdir -p "$OUT/bin"
cp "$work/build/bin/llama-server" "$BIN"
find "$work/build/bin" -name '*.so*' -exec cp -P {} "$OUT/bin/" \; 2>/dev/null || true
echo "$BIN"
