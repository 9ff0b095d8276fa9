"""A stop is a flag seen before each pop: no job is popped and dropped, and no wait for a job holds a stop up.

These drive RQ's own dequeue and kvpool's worker class against a real redis-server; the
whole process is stopped at every moment in ``tests/worker/test_process.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis
from rq.exceptions import DequeueTimeout, StopRequested
from rq.job import Job

from worker.client import submit
from worker.process import jobstream
from worker.process.main import KvpoolWorker
from worker.process.stopping import StopAwareQueue, client_name, wake
from worker.protocol import JobSpec

SHARED = "kvpool"


@pytest.fixture
def stopping(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The process-wide stop flag of this test alone (the tests' own process must not look stopped to the others)."""
    flag = threading.Event()
    monkeypatch.setattr(jobstream, "STOPPING", flag)
    return flag


def _spec() -> JobSpec:
    return JobSpec(tokens=[1, 2, 3], chain=[], chunk_size=4, model="m", enqueued_at=0.0)


def _named(redis_url: str, name: str) -> redis.Redis:
    """A connection pool of one worker: every connection carries the worker's name, as `build_worker` makes them."""
    return redis.Redis.from_url(redis_url, client_name=client_name(name))


def test_a_stopping_worker_pops_nothing(redis_url: str, stopping: threading.Event) -> None:
    conn = redis.Redis.from_url(redis_url)
    queue = StopAwareQueue(SHARED, connection=conn)
    job = submit(conn, _spec(), queue=SHARED)
    stopping.set()
    with pytest.raises(StopRequested):
        StopAwareQueue.dequeue_any([queue], None, connection=conn)
    assert queue.get_job_ids() == [job.id], "still queued, for another worker"


def test_a_job_popped_as_the_stop_came_goes_back_to_the_front_of_its_queue_unstarted(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    queue = StopAwareQueue(SHARED, connection=conn)
    popped_job = submit(conn, _spec(), queue=SHARED)
    behind = submit(conn, _spec(), queue=SHARED)
    popped = StopAwareQueue.dequeue_any([queue], None, connection=conn)
    assert popped is not None and popped[0].id == popped_job.id
    worker = KvpoolWorker([queue], connection=conn, name="stopping-w")
    worker._stop_requested = True  # the stop came between the pop and the start

    with pytest.raises(StopRequested):
        worker.execute_job(popped[0], popped[1])
    assert queue.get_job_ids() == [popped_job.id, behind.id], "back at the front: it had waited its turn"
    assert Job.fetch(popped_job.id, connection=conn).get_status() == "queued", "never started"
    assert not worker.busy


@pytest.mark.parametrize("queues", [1, 2], ids=["one-queue-blmove", "two-queues-blpop"])
def test_a_wait_for_a_job_is_woken_at_once(redis_url: str, queues: int) -> None:
    name = "waiting w.1"  # a space: Redis refuses it in a client name, `client_name` replaces it
    conn = _named(redis_url, name)
    waiting = [StopAwareQueue(f"{SHARED}:{i}", connection=conn) for i in range(queues)]
    outcome: list[object] = []

    def wait_for_a_job() -> None:
        try:
            outcome.append(StopAwareQueue.dequeue_any(waiting, 60, connection=conn))
        except DequeueTimeout as e:
            outcome.append(e)

    t = threading.Thread(target=wait_for_a_job)
    t.start()
    other = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 10
    woken = 0
    while not woken:  # until the wait has begun and is woken
        assert time.monotonic() < deadline, "the wait was never seen blocked"
        woken = wake(other, [name, "someone-else"])
    t.join(timeout=5)
    assert not t.is_alive(), "still waiting after the wake"
    assert woken == 1 and (outcome[0] is None or isinstance(outcome[0], DequeueTimeout)), outcome  # as if it had timed out


def test_waking_a_worker_that_is_not_waiting_does_nothing(redis_url: str) -> None:
    conn = _named(redis_url, "idle-w")
    conn.ping()
    assert wake(conn, ["idle-w"]) == 0
