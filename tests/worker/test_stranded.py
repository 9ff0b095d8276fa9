"""A job popped by a worker that died before starting it is queued again, and no other job ever is.

A kvpool worker listens on two queues (its own, then the shared one), so RQ pops with
BLPOP and records the job as started a few milliseconds later. A worker killed in
between takes the job out of every queue and every registry. `requeue_stranded` finds
such a job and puts it back at the front of the shared queue once it has been seen
stranded for a grace period; these tests pop jobs with RQ's own dequeue, as a worker does.
"""

from __future__ import annotations

import time

import pytest
import redis
from rq import Queue, SimpleWorker
from rq.job import Job

from worker.client import requeue_stranded, submit
from worker.protocol import JobSpec, worker_queue

SHARED = "kvpool"
GRACE_S = 0.3


@pytest.fixture
def conn(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def _spec() -> JobSpec:
    return JobSpec(tokens=[1, 2, 3], chain=[], chunk_size=4, model="m", enqueued_at=0.0)


def _pop_as_a_worker_does(conn: redis.Redis, name: str) -> Job:
    """What a kvpool worker's RQ loop does before it records the job as started; the worker then dies."""
    popped = Queue.dequeue_any([Queue(worker_queue(name), connection=conn), Queue(SHARED, connection=conn)], None, connection=conn)
    assert popped is not None
    return popped[0]


def _requeued_within(conn: redis.Redis, job_id: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not requeue_stranded(conn, job_id, SHARED, GRACE_S):
        assert time.monotonic() - t0 < timeout_s, "the stranded job was never queued again"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_job_popped_by_a_worker_that_died_is_put_back_at_the_front_of_the_shared_queue(conn: redis.Redis) -> None:
    stranded = submit(conn, _spec(), queue=SHARED)
    waiting = submit(conn, _spec(), queue=SHARED)
    assert _pop_as_a_worker_does(conn, "gone").id == stranded.id
    assert Queue(SHARED, connection=conn).get_job_ids() == [waiting.id], "popped: in no queue, and RQ still says queued"

    assert not requeue_stranded(conn, stranded.id, SHARED, GRACE_S), "first seen stranded: noted, not moved yet"
    took = _requeued_within(conn, stranded.id, 10)
    assert took >= GRACE_S * 0.9
    assert Queue(SHARED, connection=conn).get_job_ids() == [stranded.id, waiting.id], "back at the front: it had waited its turn"
    assert not requeue_stranded(conn, stranded.id, SHARED, 0.0), "queued again once, not twice"


def test_a_job_popped_from_a_dead_workers_own_queue_goes_to_the_shared_queue(conn: redis.Redis) -> None:
    job = submit(conn, _spec(), queue=worker_queue("gone"))
    assert _pop_as_a_worker_does(conn, "gone").id == job.id
    requeue_stranded(conn, job.id, SHARED, GRACE_S)
    _requeued_within(conn, job.id, 10)
    assert Queue(SHARED, connection=conn).get_job_ids() == [job.id]
    assert Job.fetch(job.id, connection=conn).origin == SHARED, "a worker that takes it finds it in the queue it came from"


def test_queued_started_and_finished_jobs_are_never_moved(conn: redis.Redis) -> None:
    queued = submit(conn, _spec(), queue=SHARED)
    for _ in range(3):
        assert not requeue_stranded(conn, queued.id, SHARED, 0.0)
    assert Queue(SHARED, connection=conn).get_job_ids() == [queued.id]

    worker = SimpleWorker([Queue(worker_queue("alive"), connection=conn), Queue(SHARED, connection=conn)], connection=conn, name="alive")
    started = _pop_as_a_worker_does(conn, "alive")
    worker.prepare_job_execution(started)  # what RQ does next: the job is started, in the started registry
    for _ in range(3):
        assert not requeue_stranded(conn, started.id, SHARED, 0.0)
    assert Queue(SHARED, connection=conn).get_job_ids() == []

    started.set_status("finished")
    assert not requeue_stranded(conn, started.id, SHARED, 0.0)
    assert not requeue_stranded(conn, "no-such-job", SHARED, 0.0)


def test_a_job_seen_stranded_for_a_moment_and_started_then_waits_the_whole_grace_if_it_is_stranded_again(conn: redis.Redis) -> None:
    """The note of when it was first seen stranded is forgotten once the job is found started."""
    job = submit(conn, _spec(), queue=SHARED)
    _pop_as_a_worker_does(conn, "w1")
    assert not requeue_stranded(conn, job.id, SHARED, GRACE_S)
    Job.fetch(job.id, connection=conn).set_status("started")
    assert not requeue_stranded(conn, job.id, SHARED, GRACE_S)
    time.sleep(GRACE_S)  # longer than the grace since it was first seen stranded
    Job.fetch(job.id, connection=conn).set_status("queued")  # retried by RQ, and popped again by a worker that dies
    assert not requeue_stranded(conn, job.id, SHARED, GRACE_S), "seen stranded anew: the grace starts again"
    assert _requeued_within(conn, job.id, 10) >= GRACE_S * 0.5
