"""The environment kvpool's tools hand the processes they start: the settings they were given, as KVPOOL_* variables."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import httpx
import pytest

from gateway.pool.bench.peers import BenchPoolSettings, kvpool_pool
from gateway.pool.envfile import settings_env
from gateway.pool.procs import child_env, free_port
from gateway.settings import GatewaySettings


def test_a_child_inherits_the_kvpool_variables_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_N_CTX", "1024")
    monkeypatch.setenv("KVPOOL_TEST_UNRELATED", "x")
    assert child_env({"KVPOOL_QUEUE": "q"})["KVPOOL_N_CTX"] == "1024"
    isolated = child_env({"KVPOOL_QUEUE": "q"}, inherit_settings=False)
    assert {k: v for k, v in isolated.items() if k.startswith("KVPOOL_")} == {"KVPOOL_QUEUE": "q"}
    assert isolated["PATH"] == os.environ["PATH"]


def test_settings_become_the_variables_that_give_them(tmp_path: Path) -> None:
    s = GatewaySettings(n_ctx=2048, state_dir=tmp_path, api_keys={"sk-a": "team-a"}, batch_api=False)
    env = settings_env(s)
    assert env == {
        "KVPOOL_N_CTX": "2048",
        "KVPOOL_STATE_DIR": str(tmp_path),
        "KVPOOL_API_KEYS": '{"sk-a":"team-a"}',
        "KVPOOL_BATCH_API": "false",
    }


def test_bench_pool_settings_ignore_this_processs_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_REDIS_URL", "redis://elsewhere:6379/0")
    monkeypatch.setenv("KVPOOL_N_CTX", "not-a-number")
    s = BenchPoolSettings(n_ctx=2048)
    assert (s.n_ctx, s.redis_url, s.model_fields_set) == (2048, GatewaySettings.model_fields["redis_url"].default, {"n_ctx"})


@pytest.mark.timeout(240)
def test_the_peers_kvpool_pool_neither_reads_nor_changes_the_environment(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvpool bench-peers`` starts its pool from settings and env dicts: this process's os.environ is not touched."""
    monkeypatch.setenv("KVPOOL_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")  # nothing listens: the pool must run its own
    monkeypatch.setenv("KVPOOL_N_CTX", "not-a-number")  # a worker or gateway reading it would not start
    before = dict(os.environ)
    with kvpool_pool(tiny_model, workers=1, threads=1, n_ctx=2048, logs=tmp_path) as (url,):
        assert dict(os.environ) == before
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
    assert dict(os.environ) == before


def test_free_ports_are_below_the_ephemeral_range_and_never_given_twice() -> None:
    """Outgoing connections take their local ports from the ephemeral range: a port handed out for a listener is not there."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports), ports
    for p in ports:  # nothing listens there
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))
