"""A thread that dies inside a worker stops the process: /readyz false at once, the job in hand ends, exit 1.

The fault is injected the only way a real worker lets one in: a wrapper process that
replaces the engine loop's round planner before the ``kvpool`` command starts, and makes it
raise once the test asks (a file appears). Nothing in the product has a switch for it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
from rq import Queue
from rq.job import Job

from gateway.pool.procs import WorkerProcess, free_port
from tests.helpers import PoolClient, prompt_text

INJECT = """
import os, sys
import worker.cpus
worker.cpus.quiet_openmp()  # what `kvpool worker` does first, before llama_cpp is loaded
worker.cpus.quiet_openmp = lambda: None
import worker.engine.loop as b
plan, trigger = b.plan_round, os.environ["KVPOOL_TEST_BREAK_LOOP_ON"]
def breaking(*a, **k):
    if os.path.exists(trigger):
        raise RuntimeError("injected: the engine loop's round planner broke")
    return plan(*a, **k)
b.plan_round = breaking
from gateway.cli import main
sys.argv = ["kvpool", "worker"]
main()
"""


class BreakableWorker(WorkerProcess):
    def args(self) -> list[str]:
        return [sys.executable, "-c", INJECT]


def test_an_engine_loop_that_dies_stops_the_worker_with_exit_1_and_fails_its_job_for_a_retry(
    pool_env, client: PoolClient, tmp_path: Path
) -> None:
    trigger, port = tmp_path / "break-now", free_port()
    env = {**pool_env, "KVPOOL_PARALLEL": "2", "KVPOOL_METRICS_PORT": str(port), "KVPOOL_TEST_BREAK_LOOP_ON": str(trigger)}
    w = BreakableWorker("b1", env, tmp_path / "b1.log").start()
    try:
        _break_and_watch(w, client, trigger, port)
    finally:
        w.kill()


def _break_and_watch(w: WorkerProcess, client: PoolClient, trigger: Path, port: int) -> None:
    assert w.proc is not None
    assert client.run(client.tokens(prompt_text(60, 40)), worker="b1.0").finish_reason, "serves before the fault"
    assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200

    trigger.touch()
    job = client.submit(client.spec(client.tokens(prompt_text(61, 40))), worker="b1.1")
    deadline = time.monotonic() + 30
    while w.proc.poll() is None:
        assert time.monotonic() < deadline, f"still running 30 s after its engine loop died:\n{w.log()[-3000:]}"
        died = "worker.thread_died" in w.log()
        try:
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
            assert ready.status_code == 503 or not died, ready.text
        except httpx.TransportError:
            pass  # the process is on its way out
        time.sleep(0.1)
    log = w.log()
    assert w.proc.returncode == 1, log[-3000:]
    assert "worker.thread_died" in log and "died=kvpool-loop" in log, log[-3000:]
    retry = Job.fetch(job, connection=client.conn)
    assert retry.get_status() == "queued" and job in Queue(client.settings.queue, connection=client.conn).get_job_ids(), (
        "the job failed where it ran and waits in the shared queue for a worker to retry it"
    )
