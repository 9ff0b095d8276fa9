"""``kvpool up`` as a new user runs it: one command, a working pool, a real request, Ctrl-C leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from gateway.pool.procs import free_port
from tests.helpers import poll, s3_client, s3_settings
from tests.terminal import Terminal

KVPOOL = str(Path(sys.executable).parent / "kvpool")


def processes_of(state_dir: Path) -> list[int]:
    """Pids whose command line or environment mentions ``state_dir``."""
    mark = str(state_dir).encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            blob = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if mark in blob and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def start_up(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([KVPOOL, "up", *args], env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = ""
    deadline = time.monotonic() + 120
    while "Ctrl-C stops everything" not in seen:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, f"kvpool up exited:\n{seen}"
        seen += line
        assert time.monotonic() < deadline, seen
    return proc, seen


def test_up_serves_requests_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    state = tmp_path / "state"
    port = free_port()
    proc, banner = start_up(["--workers", "2", "--threads", "1", "--port", str(port)], {"KVPOOL_STATE_DIR": str(state)})
    try:
        assert f"http://127.0.0.1:{port}" in banner and "(managed" in banner
        assert "worker-1 ready" in banner and "worker-2 ready" in banner and "curl" in banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        model = re.search(r'"model": "([^"]+)"', banner).group(1)
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)
        assert r.usage.completion_tokens > 0
        assert len(processes_of(state)) >= 4
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "stopped." in out
    poll(lambda: processes_of(state) == [], "every process of the pool to end")


def test_up_demo_sends_real_requests_and_reuses_the_prefix(tmp_path: Path) -> None:
    state = tmp_path / "state"
    out = subprocess.run(
        [KVPOOL, "up", "--demo", "--port", "0", "--workers", "1"],
        env={**os.environ, "KVPOOL_STATE_DIR": str(state)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    prompts = [int(m) for m in re.findall(r"(\d+) prompt tokens", out.stdout)]
    cached = [int(m) for m in re.findall(r"(\d+) cached", out.stdout)]
    assert cached[0] == 0 and cached[1] >= 0.9 * prompts[1] > 300
    assert "Quay Street" in out.stdout  # SmolLM2 answers from the handbook, in English
    assert processes_of(state) == []
    libraries = [
        line for line in (out.stdout + out.stderr).splitlines() if "HTTP Request" in line or " httpx " in line or " httpcore" in line
    ]
    assert libraries == [], "the demo prints kvpool's own lines, not its HTTP client's"


def test_up_takes_the_model_from_the_bucket(tmp_path: Path, tiny_model: Path, s3_server, redis_url: str) -> None:
    settings = s3_settings(s3_server.endpoint_url, "kvpool-models", redis_url)
    s3 = s3_client(settings)
    s3.create_bucket(Bucket="kvpool-models")
    s3.upload_file(str(tiny_model), "kvpool-models", "models/tiny.gguf")
    state = tmp_path / "state"
    env = {
        "KVPOOL_STATE_DIR": str(state),
        "KVPOOL_REDIS_URL": redis_url,
        "KVPOOL_STORE_URL": settings.store_url,
        "KVPOOL_S3_ENDPOINT_URL": s3_server.endpoint_url,
        "KVPOOL_S3_ACCESS_KEY_ID": settings.s3_access_key_id,
        "KVPOOL_S3_SECRET_ACCESS_KEY": settings.s3_secret_access_key,
    }
    port = free_port()
    proc, banner = start_up(["--model", "s3://kvpool-models/models/tiny.gguf", "--workers", "1", "--port", str(port)], env)
    try:
        local = state / "models" / "s3" / "kvpool-models" / "models" / "tiny.gguf"
        assert str(local) in banner and local.read_bytes() == tiny_model.read_bytes()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert client.completions.create(model="tiny", prompt="hello", max_tokens=4).usage.completion_tokens > 0
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_a_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    out = subprocess.run(
        [KVPOOL, "up", "--model", str(tmp_path / "nope.gguf"), "--port", "0"],
        env={**os.environ, "KVPOOL_STATE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "model not found" in out.stderr and "Traceback" not in out.stderr
    assert processes_of(tmp_path) == []


def test_ctrl_c_in_a_terminal_then_up_again_answers_at_once(tmp_path: Path) -> None:
    """In a real terminal: a pool with a request in flight, Ctrl-C, and ``kvpool up`` again on the same state.

    Ctrl-C must reach only the supervisor (Redis, workers and the gateway run in sessions of
    their own and are stopped in order), and the second pool must serve at once: no worker
    name held by a dead registration, no stale advert taken for a live worker.
    """
    state = tmp_path / "state"
    port = free_port()
    argv = [KVPOOL, "up", "--workers", "2", "--threads", "1", "--port", str(port)]
    env = {**os.environ, "KVPOOL_STATE_DIR": str(state)}
    question = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
    }
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    first = Terminal(argv, env)
    try:
        first.wait_for("Ctrl-C stops everything", 180)
        stream = client.chat.completions.create(**question, max_tokens=400, temperature=0, stream=True)
        next(iter(stream))  # a job is running when Ctrl-C comes
        first.ctrl_c()
        assert first.wait(90) == 0, first.screen
    finally:
        first.close()
    assert "stopped." in first.screen
    assert processes_of(state) == []

    second = Terminal(argv, env)
    try:
        second.wait_for("Ctrl-C stops everything", 60)
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz").json()
        assert ready["checks"]["workers"] == 2, ready  # both new workers registered, and no advert left by the first pool
        answer = client.chat.completions.create(**question, max_tokens=8, temperature=0)
        assert answer.choices[0].message.content
        second.ctrl_c()
        assert second.wait(60) == 0, second.screen
    finally:
        second.close()
    assert processes_of(state) == []
