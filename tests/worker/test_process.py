"""The worker process survives what real pools do to it: SIGKILL and restart, a name clash, Redis restarting."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from rq import Queue, Worker

from gateway.pool.procs import RedisServer, WorkerProcess, free_port
from tests.helpers import PoolClient, poll, prompt_text
from worker.advert import STARTING_KEY, adverts, process_key
from worker.protocol import stream_key, worker_queue

KVPOOL = str(Path(sys.executable).parent / "kvpool")


def test_a_killed_worker_starts_again_at_once_under_its_name(start_worker, client: PoolClient) -> None:
    w1 = start_worker("w1")
    prompt = client.tokens(prompt_text(21, 60))
    assert client.run(prompt, worker="w1").worker == "w1"
    w1.kill()  # SIGKILL: its RQ registration and advert stay behind in Redis
    again = start_worker("w1")
    assert "stale_registration_cleared" in again.log()
    assert client.run(prompt, worker="w1").worker == "w1"


def _long_job_under_way(client: PoolClient, seed: int) -> str:
    """A job for w1 that never meets its end-of-text token, once w1 is streaming its tokens."""
    never_stop = {client.vocab.token_eos(): -100.0}
    job = client.submit(client.spec(client.tokens(prompt_text(seed, 40)), max_tokens=1500, logit_bias=never_stop), worker="w1")
    deadline = time.monotonic() + 30
    while not client.conn.xlen(stream_key(job)) > 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return job


def test_a_worker_killed_mid_job_hands_the_job_on(start_worker, client: PoolClient) -> None:
    w1 = start_worker("w1")
    job = _long_job_under_way(client, 22)
    w1.kill()
    start_worker("w1")
    out = client.collect(job, timeout_s=60)
    assert out.result is not None and len(out.starts) == 2, out.error


def test_a_second_live_worker_of_the_same_name_is_refused_before_loading_the_model(start_worker, pool_env, tmp_path: Path) -> None:
    start_worker("w1")
    env = {**os.environ, **pool_env, "KVPOOL_WORKER_NAME": "w1"}
    done = subprocess.run([KVPOOL, "worker"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "a live worker named 'w1' is registered" in done.stderr
    assert "worker.ready" not in done.stderr + done.stdout and "restore.selfcheck" not in done.stderr + done.stdout


@pytest.mark.parametrize("persist", [True, False], ids=["aof", "data-lost"])
def test_a_worker_rides_out_a_redis_restart(pool_env, tiny_model, tmp_path: Path, persist: bool) -> None:
    server = RedisServer(tmp_path / "redis", persist=persist).start()
    conn = redis.Redis.from_url(server.url)
    w = WorkerProcess("w1", {**pool_env, "KVPOOL_REDIS_URL": server.url}, tmp_path / "w1.log").start()
    try:
        client = PoolClient(conn, tiny_model)
        prompt = client.tokens(prompt_text(23, 50))
        first = client.run(prompt)
        server.stop()
        server = RedisServer(tmp_path / "redis", port=server.port, persist=persist).start()
        deadline = time.monotonic() + 15
        while not any(a.worker == "w1" for a in adverts(conn)):  # it registers again by itself
            assert w.proc is not None and w.proc.poll() is None, w.log()[-2000:]
            assert time.monotonic() < deadline, w.log()[-2000:]
            time.sleep(0.1)
        assert client.run(prompt).tokens == first.tokens
    finally:
        w.stop()
        server.stop()


def test_a_worker_stopped_with_jobs_in_its_own_queue_hands_them_to_the_shared_queue(start_worker, client: PoolClient) -> None:
    """SIGTERM finishes the job in hand; what was routed to this worker behind it must not wait for a worker that is gone."""
    w1 = start_worker("w1")
    running = _long_job_under_way(client, 24)
    waiting = client.submit(client.spec(client.tokens(prompt_text(25, 40))), worker="w1")
    assert w1.stop(timeout_s=120) == 0
    assert client.collect(running, timeout_s=5).result is not None, "warm shutdown: the job in hand finished"
    shared = Queue(client.settings.queue, connection=client.conn)
    assert waiting in shared.get_job_ids()
    assert Queue(worker_queue("w1"), connection=client.conn).get_job_ids() == []


def _log_shows(w: WorkerProcess, text: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in w.log():
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{w.log()[-3000:]}"
        time.sleep(0.1)


def _terminate(w: WorkerProcess, timeout_s: float) -> int:
    """SIGTERM, as Kubernetes sends on scale-down; the exit status once the process is gone within ``timeout_s``."""
    assert w.proc is not None
    w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while w.proc.poll() is None:
        assert time.monotonic() < deadline, f"still running {timeout_s:g} s after SIGTERM:\n{w.log()[-3000:]}"
        time.sleep(0.1)
    return w.proc.returncode


def test_sigterm_while_redis_is_away_stops_an_idle_worker_at_once(start_worker, tmp_path: Path) -> None:
    """No job runs and nothing can be handed back to an unreachable Redis: the stop request ends the wait, and the exit is clean."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        w = start_worker("w1", KVPOOL_REDIS_URL=server.url)
        server.stop()
        _log_shows(w, "could not connect to Redis")  # RQ's loop is retrying
        assert _terminate(w, timeout_s=20) == 0
        assert "worker.stopped" in w.log()
    finally:
        server.stop()


def test_sigterm_while_the_worker_waits_for_redis_after_losing_its_job(start_worker, tiny_model, tmp_path: Path) -> None:
    """Redis went away mid-job, the RQ loop ended and the worker waits for Redis itself: a stop request ends that wait too."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        w = start_worker("w1", KVPOOL_REDIS_URL=server.url)
        _long_job_under_way(PoolClient(redis.Redis.from_url(server.url), tiny_model), 26)
        server.stop()
        _log_shows(w, "redis.unavailable")
        assert _terminate(w, timeout_s=20) == 0
        assert "worker.stopped" in w.log()
    finally:
        server.stop()


REPEATS = 5
"""Workers stopped at each moment, side by side: a stop that hangs now and then shows up in one of them."""


@pytest.mark.serial  # a wall-clock bound
@pytest.mark.parametrize("moment", [0.5, 2.0, 4.0, 8.0, "after_a_request"])
def test_sigterm_stops_an_idle_worker_of_four_sequences_within_10_s(start_worker, client: PoolClient, moment: float | str) -> None:
    """Every sequence's RQ worker stops, its wait for a job woken, and the process exits 0 within 10 s, every time.

    RQ's teardown used to wait up to a minute for its pubsub thread, and the sequences in
    threads stopped only at their next heartbeat (5 s).
    """
    workers = [start_worker(f"s{i}", KVPOOL_PARALLEL="4") for i in range(REPEATS)]
    ready_at = time.monotonic()
    if moment == "after_a_request":
        for i, w in enumerate(workers):
            assert client.run(client.tokens(prompt_text(40 + i, 40)), worker=f"{w.name}.{i % 4}").finish_reason
    else:
        assert isinstance(moment, float)
        time.sleep(max(0.0, ready_at + moment - time.monotonic()))  # the moment under test, not a wait for work
    for w in workers:
        assert w.proc is not None
        w.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    for w in workers:
        assert w.proc is not None
        rc = w.proc.wait(timeout=max(0.1, t0 + 10 - time.monotonic()))
        log = w.log()
        assert rc == 0, log[-2000:]
        assert all(f"Worker {n}: unsubscribing from channel" in log for n in w.names), log[-2000:]  # RQ's teardown, each
        assert "loop.totals" in log, "the engines closed: the context's engine loop logged its totals"
        assert not {x.name for x in Worker.all(connection=w.conn)} & set(w.names), "RQ registrations left behind"


@pytest.mark.serial  # a wall-clock bound
def test_sigterm_with_a_job_running_on_one_of_four_sequences_exits_within_10_s_of_its_answer(start_worker, client: PoolClient) -> None:
    w = start_worker("s", KVPOOL_PARALLEL="4")
    never_stop = {client.vocab.token_eos(): -100.0}
    job = client.submit(client.spec(client.tokens(prompt_text(47, 40)), max_tokens=1500, logit_bias=never_stop), worker="s.2")
    deadline = time.monotonic() + 30
    while not client.conn.xlen(stream_key(job)) > 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert w.proc is not None
    w.proc.send_signal(signal.SIGTERM)
    out = client.collect(job, timeout_s=120)
    assert out.result is not None and out.result.usage.completion_tokens == 1500, "warm shutdown: the job in hand finished"
    assert w.proc.wait(timeout=10) == 0, w.log()[-2000:]


def test_a_starting_worker_announces_itself_until_its_first_advert(pool_env, tmp_path: Path) -> None:
    """A gateway tells a pool still loading its workers from one whose workers died by these announcements (`worker.process.starting`)."""
    w = WorkerProcess("w1", pool_env, tmp_path / "w1.log").spawn()
    assert w.proc is not None
    try:
        mine = process_key(socket.gethostname(), w.proc.pid)
        assert w.conn.hexists(STARTING_KEY, mine), "announced by its spawner, before Python has started"
        w.conn.delete(STARTING_KEY)  # what follows is the worker's own announcement
        poll(lambda: w.conn.hexists(STARTING_KEY, mine), "the worker to announce itself while its model loads")
        w.wait_ready()
        assert not w.conn.hexists(STARTING_KEY, mine), "its first advert ends the announcement"
    finally:
        w.kill()


@pytest.mark.parametrize("moment", ["while_the_model_loads", "as_soon_as_it_advertises"])
def test_sigterm_at_any_moment_of_start_up_exits_0_and_leaves_nothing_registered(pool_env, tmp_path: Path, moment: str) -> None:
    """RQ takes signals only once it has registered the worker; a stop in between used to kill the process (-15)."""
    w = WorkerProcess("w4", {**pool_env, "KVPOOL_PARALLEL": "4"}, tmp_path / "w4.log").spawn()
    assert w.proc is not None
    try:
        deadline = time.monotonic() + 120
        if moment == "while_the_model_loads":
            while "worker.threads" not in w.log():  # logged just before the model is loaded
                assert w.proc.poll() is None and time.monotonic() < deadline, w.log()[-2000:]
                time.sleep(0.01)
        else:
            while not any(a.pid == w.proc.pid for a in adverts(w.conn)):
                assert w.proc.poll() is None and time.monotonic() < deadline, w.log()[-2000:]
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(timeout=30) == 0, w.log()[-2000:]
    finally:
        w.kill()
    assert not {x.name for x in Worker.all(connection=w.conn)} & set(w.names), "RQ registrations left behind"
    assert not any(a.pid == w.proc.pid for a in adverts(w.conn)), "an advert left behind"
    assert not w.conn.hlen(STARTING_KEY), "its announcement as starting left behind: a gateway would wait for it"


def test_sigterm_while_a_starting_worker_waits_for_redis_exits_0_at_once(pool_env, tmp_path: Path) -> None:
    """Redis is not there yet when the worker starts: it waits, and a stop ends that wait rather than being ignored."""
    gone = f"redis://127.0.0.1:{free_port()}/0"
    w = WorkerProcess("w1", {**pool_env, "KVPOOL_REDIS_URL": gone}, tmp_path / "w1.log").spawn()
    try:
        _log_shows(w, "redis.unavailable")
        assert _terminate(w, timeout_s=20) == 0, w.log()[-2000:]
        assert "worker.stopped" in w.log() and "worker.threads" not in w.log(), "stopped before loading the model"
    finally:
        w.kill()
