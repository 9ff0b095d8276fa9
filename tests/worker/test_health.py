"""The worker's probe endpoints, on a real worker process: alive from the start, ready only once it can take jobs."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from gateway.pool.procs import RedisServer, WorkerProcess, free_port
from worker.process.health import Health, self_check_outcome


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def poll(port: int, path: str, until: Callable[[int, str], bool], worker: WorkerProcess, timeout_s: float = 90.0) -> tuple[int, str]:
    """GET ``path`` until ``until(status, body)`` holds; a refused connection counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert worker.proc is not None and worker.proc.poll() is None, f"the worker exited:\n{worker.log()[-3000:]}"
        try:
            status, body = get(port, path)
            if until(status, body):
                return status, body
        except (ConnectionError, urllib.error.URLError):
            pass
        assert time.monotonic() < deadline, f"{path} never became what was expected; log:\n{worker.log()[-3000:]}"
        time.sleep(0.1)


@pytest.fixture
def redis_port() -> int:
    return free_port()


def test_a_starting_worker_is_alive_but_not_ready_until_it_takes_jobs(pool_env: dict[str, str], redis_port: int, tmp_path: Path) -> None:
    """Redis is not there yet, so the worker cannot register or load its model: alive, not ready, and saying why."""
    port = free_port()
    url = f"redis://127.0.0.1:{redis_port}/0"
    worker = WorkerProcess("h1", {**pool_env, "KVPOOL_REDIS_URL": url, "KVPOOL_METRICS_PORT": str(port)}, tmp_path / "h1.log").spawn()
    server = None
    try:
        assert poll(port, "/healthz", lambda s, _: s == 200, worker)[1] == '{"status": "ok"}'
        status, body = get(port, "/readyz")
        assert status == 503
        report = json.loads(body)
        assert report["status"] == "not ready" and report["checks"]["model"] == "the model is loading"
        assert report["reason"]

        server = RedisServer(tmp_path / "redis", port=redis_port).start()
        status, body = poll(port, "/readyz", lambda s, _: s == 200, worker)
        report = json.loads(body)
        assert report["status"] == "ready" and "reason" not in report
        assert report["checks"] == {"model": "loaded", "self_check": report["checks"]["self_check"], "registered": True}
        assert report["checks"]["self_check"].startswith("passed")
        assert any(a.worker == "h1" for a in _adverts(url)), "ready means registered: the gateway can route to it"

        status, metrics = get(port, "/metrics")
        assert status == 200 and "kvpool_worker_busy" in metrics and "kvpool_worker_restore_enabled" in metrics
        assert get(port, "/nothing")[0] == 404
    finally:
        worker.stop()
        if server is not None:
            server.stop()


def test_a_worker_that_loses_redis_stays_alive_and_turns_unready_until_it_is_back(
    pool_env: dict[str, str], redis_port: int, tmp_path: Path
) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{redis_port}/0"
    server = RedisServer(tmp_path / "redis", port=redis_port).start()
    worker = WorkerProcess("h2", {**pool_env, "KVPOOL_REDIS_URL": url, "KVPOOL_METRICS_PORT": str(port)}, tmp_path / "h2.log")
    try:
        worker.start()
        assert get(port, "/readyz")[0] == 200
        server.stop()
        status, body = poll(port, "/readyz", lambda s, _: s == 503, worker)
        assert "Redis is unreachable" in json.loads(body)["reason"]
        assert get(port, "/healthz")[0] == 200, "an outage of Redis is no reason to restart the worker"
        server = RedisServer(tmp_path / "redis", port=redis_port).start()
        poll(port, "/readyz", lambda s, _: s == 200, worker)
    finally:
        worker.stop()
        server.stop()


def _adverts(url: str) -> list:
    from worker.advert import adverts

    return adverts(redis.Redis.from_url(url))


# --------------------------------------------------------------------------- the readiness rule itself


def test_readiness_needs_the_model_the_self_check_and_the_registration() -> None:
    health = Health()
    assert health.report()[0] is False
    health.registered(True)
    assert health.report()[1]["reason"] == "the model is loading"
    health.model_loaded(self_check="passed, exact", passed=True)
    assert health.report() == (True, {"status": "ready", "checks": {"model": "loaded", "self_check": "passed, exact", "registered": True}})
    health.registered(False)
    assert health.report()[0] is False
    health.registered(True)
    health.stopping()
    ready, body = health.report()
    assert not ready and body["reason"].startswith("shutting down")


def test_readiness_asks_redis_last() -> None:
    def unreachable() -> None:
        raise redis.ConnectionError("Connection refused")

    health = Health(ping=unreachable)
    health.model_loaded(self_check="passed, exact", passed=True)
    health.registered(True)
    ready, body = health.report()
    assert not ready and body["reason"] == "Redis is unreachable: ConnectionError"


@pytest.mark.parametrize(
    ("cuttable", "enabled", "restore_enabled", "ready"),
    [
        (True, True, True, True),
        (True, True, False, False),  # the check ran and failed: a rollout of this image or layout should stop
        (True, False, True, True),  # KVPOOL_SELF_CHECK=false: the operator's call
        (False, True, False, True),  # a layout that cannot be cut is served cold, by design
    ],
)
def test_a_failed_self_check_keeps_the_worker_unready(cuttable: bool, enabled: bool, restore_enabled: bool, ready: bool) -> None:
    outcome, passed = self_check_outcome(cuttable, enabled, restore_enabled, exact=False)
    health = Health()
    health.registered(True)
    health.model_loaded(self_check=outcome, passed=passed)
    assert health.report()[0] is ready
    assert passed is ready
