"""The jobs a dead worker's own queue holds go to the shared queue once each, whoever moves them and however many at once."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import redis
from rq import Queue

from worker.client import submit
from worker.process.registration import rescue_orphaned_queues
from worker.protocol import JobSpec, worker_queue

SHARED = "kvpool"


@pytest.fixture
def conn(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def _spec() -> JobSpec:
    return JobSpec(tokens=[1, 2, 3], chain=[], chunk_size=4, model="m", enqueued_at=0.0)


def test_workers_rescuing_the_same_dead_queue_at_once_enqueue_each_job_once(conn: redis.Redis) -> None:
    ids = [submit(conn, _spec(), queue=worker_queue("gone")).id for _ in range(200)]
    shared = Queue(SHARED, connection=conn)
    moved: list[int] = []
    start = threading.Barrier(4)

    def rescuer() -> None:
        start.wait()
        moved.append(rescue_orphaned_queues(conn, shared))

    threads = [threading.Thread(target=rescuer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counter(shared.get_job_ids()) == Counter(ids), "every job once in the shared queue, none twice"
    assert sum(moved) == len(ids)
    assert Queue(worker_queue("gone"), connection=conn).get_job_ids() == []


def test_a_job_whose_record_expired_is_dropped_and_the_others_still_move(conn: redis.Redis) -> None:
    first = submit(conn, _spec(), queue=worker_queue("gone"))
    expired = submit(conn, _spec(), queue=worker_queue("gone"))
    last = submit(conn, _spec(), queue=worker_queue("gone"))
    conn.delete(expired.key)
    shared = Queue(SHARED, connection=conn)

    assert rescue_orphaned_queues(conn, shared) == 2
    assert shared.get_job_ids() == [first.id, last.id]
    assert Queue(worker_queue("gone"), connection=conn).get_job_ids() == []
