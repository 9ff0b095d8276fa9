"""A request whose job a dying worker popped, but never started, is still answered: the gateway queues the job again.

The gap is RQ's: a worker of two queues pops a job with BLPOP and records it as started a
few milliseconds later. A worker SIGKILLed in between leaves the job in no queue and no
registry; RQ sees it as queued forever, and the client would wait until its deadline.
"""

from __future__ import annotations

import threading
import time

import httpx
import redis
from rq import Queue

from tests.helpers import MODEL
from worker.protocol import worker_queue
from worker.settings import WorkerSettings


def test_a_job_a_dying_worker_popped_is_queued_again_and_answered(start_gateway, start_worker, redis_url: str) -> None:
    gw = start_gateway(KVPOOL_QUEUE_WITHOUT_WORKERS="true", KVPOOL_REQUEST_TIMEOUT_S="120")
    conn = redis.Redis.from_url(redis_url)
    shared = Queue(WorkerSettings().queue, connection=conn)
    answers: list[httpx.Response] = []
    request = threading.Thread(
        target=lambda: answers.append(
            httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "lost and found", "max_tokens": 4}, timeout=150)
        )
    )
    request.start()
    deadline = time.monotonic() + 30
    while shared.count == 0:
        assert request.is_alive() and time.monotonic() < deadline, answers and answers[0].text
        time.sleep(0.05)

    popped = Queue.dequeue_any([Queue(worker_queue("dying"), connection=conn), shared], None, connection=conn)
    assert popped is not None and shared.count == 0  # popped as a worker does; the worker dies before starting it
    t0 = time.monotonic()
    start_worker("w1")
    request.join(timeout=120)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert answers[0].json()["usage"]["completion_tokens"] >= 1
    assert time.monotonic() - t0 < 60, "answered well before the request's deadline"
    assert 'kvpool_gateway_resubmitted_total{reason="stranded"} 1.0' in httpx.get(gw.url + "/metrics").text
