"""A pool scaled to zero: with KVPOOL_QUEUE_WITHOUT_WORKERS the gateway stays ready and queues requests, which is what wakes the autoscaler."""

from __future__ import annotations

import threading
import time

import httpx
import redis
from rq import Queue

from tests.helpers import MODEL
from worker.settings import WorkerSettings


def test_a_request_waits_in_the_shared_queue_until_the_first_worker_starts(start_gateway, start_worker, redis_url: str) -> None:
    gw = start_gateway(KVPOOL_QUEUE_WITHOUT_WORKERS="true")
    ready = httpx.get(gw.url + "/readyz")
    assert ready.status_code == 200, "no worker, yet ready: else the Service would take the gateway out and no request could wake the pool"
    assert ready.json()["checks"]["workers"] == "no live worker"

    answers: list[httpx.Response] = []
    request = threading.Thread(
        target=lambda: answers.append(
            httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "wake up", "max_tokens": 4}, timeout=120)
        )
    )
    request.start()
    shared = Queue(WorkerSettings().queue, connection=redis.Redis.from_url(redis_url))
    deadline = time.monotonic() + 30
    while shared.count == 0:  # the length KEDA's redis trigger reads: LLEN rq:queue:kvpool
        assert request.is_alive() and time.monotonic() < deadline, answers and answers[0].text
        time.sleep(0.05)
    assert shared.key == "rq:queue:kvpool"

    start_worker("w1")
    request.join(timeout=60)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert answers[0].json()["usage"]["completion_tokens"] <= 4


def test_without_the_setting_no_worker_is_still_an_immediate_503(start_gateway) -> None:
    gw = start_gateway(KVPOOL_START_WAIT_S="0")  # nor a wait for a starting pool (test_pool_starting.py)
    assert httpx.get(gw.url + "/readyz").status_code == 503
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"
