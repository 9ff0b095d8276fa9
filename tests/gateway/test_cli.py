"""The root ``kvpool`` command: every command gets its settings one way, and a bad KVPOOL_* value is a usage error naming it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gateway.cli import main


@pytest.fixture(autouse=True)
def no_kvpool_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVPOOL_")]:
        monkeypatch.delenv(name)


BAD = [
    (["gateway"], "KVPOOL_PORT", "http", "Input should be a valid integer"),
    (["worker"], "KVPOOL_N_BATCH", "1", "Input should be greater than or equal to 3"),
    (["up"], "KVPOOL_JOB_ATTEMPTS", "0", "Input should be greater than or equal to 1"),
    (["model", "fetch"], "KVPOOL_MODEL_SHA256", "not-hex", "String should match pattern"),
    (["store", "stats"], "KVPOOL_IO_THREADS", "0", "Input should be greater than or equal to 1"),
    (["gateway"], "KVPOOL_API_KEYS", "sk-a=team", "not valid JSON"),
]


@pytest.mark.parametrize(("args", "variable", "value", "why"), BAD, ids=[f"{' '.join(a)}-{v}" for a, v, _, _ in BAD])
def test_a_bad_value_is_a_usage_error_naming_the_variable(args: list[str], variable: str, value: str, why: str) -> None:
    result = CliRunner().invoke(main, args, env={variable: value}, prog_name="kvpool")
    assert result.exit_code == 2, result.output
    assert "Usage: kvpool" in result.output and f"{variable}: {why}" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), "no traceback"


def test_batch_names_the_variable_too(tmp_path: Path) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text("")
    result = CliRunner().invoke(
        main, ["batch", str(requests), "-o", str(tmp_path / "out.jsonl")], env={"KVPOOL_MAX_WAITING_JOBS": "0"}, prog_name="kvpool"
    )
    assert result.exit_code == 2, result.output
    assert "Usage: kvpool batch" in result.output and "KVPOOL_MAX_WAITING_JOBS: Input should be greater than or equal to 1" in result.output


def test_a_setting_only_the_pool_reads_does_not_stop_a_store_command(tmp_path: Path, redis_url: str) -> None:
    """The root reads the store's settings; `kvpool store` needs nothing more, so a bad chunk size is not its concern."""
    env = {"KVPOOL_CHUNK_SIZE": "0", "KVPOOL_REDIS_URL": redis_url, "KVPOOL_STORE_URL": str(tmp_path / "blobs")}
    result = CliRunner().invoke(main, ["store", "stats", "--json"], env=env)
    assert result.exit_code == 0, result.output
    assert '"chunks": 0' in result.output


def kvpool_without(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvpool ARGS`` in a Python where ``module`` cannot be imported, as when its extra is not installed."""
    code = f"import sys; sys.modules[{module!r}] = None; from gateway.cli import main; main({list(args)!r}, prog_name='kvpool')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_without_the_pool_extra_the_pool_commands_say_what_to_install() -> None:
    shown = kvpool_without("httpx", "--help")
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"up\s+\(not installed\) needs httpx", shown.stdout) and re.search(r"gateway\s+Serve", shown.stdout)
    up = kvpool_without("httpx", "up", "--demo")
    assert up.returncode == 1 and "Traceback" not in up.stderr
    assert "kvpool up needs httpx, which is not installed: pip install 'kvpool[pool]'" in up.stderr


def test_without_gguf_a_worker_starts_and_model_make_says_what_to_install(tmp_path: Path) -> None:
    assert kvpool_without("gguf", "worker", "--help").returncode == 0
    make = kvpool_without("gguf", "model", "make", "--out", str(tmp_path / "m.gguf"))
    assert make.returncode == 1 and "Traceback" not in make.stderr
    assert "generating a model needs the gguf package: pip install 'kvpool[synth]'" in make.stderr
    assert not (tmp_path / "m.gguf").exists()
