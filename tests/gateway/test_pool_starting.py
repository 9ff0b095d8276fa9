"""A starting pool does not turn requests away: ready means ready.

A client that starts a pool and sends at once (or polls ``/v1/models`` for 200 first, as it
would llama-server) must not get 503 because the first worker is still loading. A pool
whose workers were live and are all gone still answers 503 at once.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import redis

from gateway.pool.procs import WorkerProcess
from tests.helpers import MODEL, poll
from worker.advert import STARTING_KEY

BODY = {"model": MODEL, "prompt": "first words", "max_tokens": 4}
MESSAGE = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def send_in_background(url: str, path: str, body: dict, **headers: str) -> tuple[threading.Thread, list[httpx.Response]]:
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(httpx.post(url + path, json=body, headers=headers, timeout=120)))
    sender.start()
    return sender, answers


def test_a_request_sent_as_the_gateway_opens_waits_for_the_first_worker(start_gateway, start_worker) -> None:
    """The gateway's port has just opened and no worker has started yet: the requests wait for it instead of a 503."""
    gw = start_gateway()  # returns the moment /healthz answers
    completion = send_in_background(gw.url, "/v1/completions", BODY)
    message = send_in_background(gw.url, "/v1/messages", MESSAGE)  # Anthropic's API waits alike
    poll(lambda: gw.log().count("request.waiting_for_worker") >= 2 or completion[1] or message[1], "both requests waiting")
    assert not completion[1] and not message[1], [r.text for r in completion[1] + message[1]]

    start_worker("w1")
    for sender, answers in (completion, message):
        sender.join(timeout=120)
        assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert completion[1][0].json()["usage"]["completion_tokens"] <= 4
    assert message[1][0].json()["type"] == "message"


def test_models_answers_503_until_a_worker_is_live_so_polling_for_200_then_sending_works(start_gateway, start_worker) -> None:
    gw = start_gateway()
    assert httpx.get(gw.url + "/healthz").status_code == 200, "liveness: the process is up"
    r = httpx.get(gw.url + "/v1/models")
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    assert r.json()["error"]["code"] == "no_workers" and "starting" in r.json()["error"]["message"]

    start_worker("w1")
    poll(lambda: httpx.get(gw.url + "/v1/models").status_code == 200, "/v1/models to answer 200")
    assert httpx.get(gw.url + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.post(gw.url + "/v1/completions", json=BODY, timeout=60).status_code == 200


def test_a_pool_restarting_its_workers_waits_for_them(start_worker, start_gateway, pool_env, redis_url, tmp_path) -> None:
    """A pool that had live workers (a restart, as `kvpool up` after Ctrl-C): a worker being spawned counts as starting."""
    start_worker("w1").stop()
    gw = start_gateway(KVPOOL_START_WAIT_S="60")
    assert httpx.post(gw.url + "/v1/completions", json=BODY).status_code == 503, "workers gone, none starting"

    again = WorkerProcess("w1", pool_env, tmp_path / "w1-again.log").spawn()  # announced as starting from its spawn
    try:
        assert redis.Redis.from_url(redis_url).hlen(STARTING_KEY) == 1
        sender, answers = send_in_background(gw.url, "/v1/completions", BODY)
        sender.join(timeout=120)
        assert answers and answers[0].status_code == 200, answers and answers[0].text
        assert "request.waiting_for_worker" in gw.log(), "answered without waiting: the worker was ready first"
        assert redis.Redis.from_url(redis_url).hlen(STARTING_KEY) == 0, "its first advert ends the announcement"
    finally:
        again.kill()


def test_a_request_with_an_idempotency_key_keeps_its_claim_while_it_waits(start_gateway, start_worker, redis_url) -> None:
    """The key's claim outlives a gateway that died before enqueueing by 40 s; a live one waiting for a worker renews it."""
    gw = start_gateway(KVPOOL_START_WAIT_S="120")
    sender, answers = send_in_background(gw.url, "/v1/completions", BODY, **{"Idempotency-Key": "first-request"})
    poll(lambda: "request.waiting_for_worker" in gw.log() or bool(answers), "the request to wait")
    conn = redis.Redis.from_url(redis_url)
    [claim] = conn.keys("kvpool:idempotency:*")
    first_ttl, seen_at = conn.pttl(claim), time.monotonic()

    def renewed() -> bool:  # at least 2 s longer to live than had it only run down since first seen
        return conn.pttl(claim) > first_ttl - (time.monotonic() - seen_at) * 1000 + 2000

    poll(renewed, "the claim to be renewed", timeout_s=30)

    start_worker("w1")
    sender.join(timeout=120)
    assert answers and answers[0].status_code == 200, answers and answers[0].text


@pytest.mark.serial  # a wall-clock bound
def test_workers_all_gone_is_503_at_once(start_worker, start_gateway) -> None:
    w = start_worker("w1")
    gw = start_gateway(KVPOOL_START_WAIT_S="60")
    assert httpx.post(gw.url + "/v1/completions", json=BODY, timeout=60).status_code == 200
    w.stop()

    t0 = time.monotonic()
    r = httpx.post(gw.url + "/v1/completions", json=BODY, timeout=60)
    assert time.monotonic() - t0 < 5, "a pool whose workers died is not waited for"
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    assert r.json()["error"]["code"] == "no_workers" and "no live worker" in r.json()["error"]["message"]
    assert httpx.get(gw.url + "/v1/models").status_code == 503


@pytest.mark.serial  # a wall-clock bound
def test_no_worker_ever_coming_ends_in_a_clear_503_within_the_wait(start_gateway) -> None:
    gw = start_gateway(KVPOOL_START_WAIT_S="1.5")
    t0 = time.monotonic()
    r = httpx.post(gw.url + "/v1/completions", json=BODY, timeout=60)
    waited = time.monotonic() - t0
    assert 1.5 <= waited < 6, waited
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    err = r.json()["error"]
    assert err["code"] == "no_workers" and "starting" in err["message"] and "KVPOOL_START_WAIT_S" in err["message"], err


@pytest.mark.serial  # a wall-clock bound
def test_the_wait_counts_toward_the_request_deadline(start_gateway) -> None:
    gw = start_gateway(KVPOOL_START_WAIT_S="600", KVPOOL_REQUEST_TIMEOUT_S="1.5")
    t0 = time.monotonic()
    r = httpx.post(gw.url + "/v1/completions", json=BODY, timeout=60)
    waited = time.monotonic() - t0
    assert 1.5 <= waited < 6, waited
    assert r.status_code == 503 and "KVPOOL_REQUEST_TIMEOUT_S" in r.json()["error"]["message"], r.text
