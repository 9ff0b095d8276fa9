"""Idempotency-Key: a retried request gets the first attempt's answer from the first attempt's job, on any gateway.

Jobs are counted without looking inside the gateway: each one enqueued leaves its RQ job
hash in Redis, and each one a worker ran is counted in its Prometheus metrics.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from rq.job import Job

from gateway.pool.procs import free_port
from tests.helpers import MODEL, openai_client, prompt_text
from worker.protocol import stream_key

KEY = "Idempotency-Key"
NO_EOS = {"logit_bias": {"2": -100}, "temperature": 0}
"""The tiny model's end-of-generation token banned: an answer runs to max_tokens."""


def jobs_enqueued(redis_url: str) -> int:
    conn = redis.Redis.from_url(redis_url)
    return sum(1 for k in conn.scan_iter("rq:job:*") if k.count(b":") == 2)


def jobs_run(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "kvpool_worker_jobs_total")


def outcomes(gateway_url: str) -> dict[str, float]:
    """The gateway's count of keyed requests by outcome (new, attached, rerun, conflict)."""
    text = httpx.get(gateway_url + "/metrics").text
    return {
        s.labels["outcome"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kvpool_gateway_idempotent_requests_total"
    }


def assert_jobs(redis_url: str, metrics_port: int, n: int) -> None:
    """Exactly ``n`` jobs were enqueued, and the worker has run them all (it counts a job once it is done with it)."""
    assert jobs_enqueued(redis_url) == n
    deadline = time.monotonic() + 30
    while jobs_run(metrics_port) < n:
        assert time.monotonic() < deadline, f"the worker ran {jobs_run(metrics_port)} of {n} jobs"
        time.sleep(0.05)
    assert jobs_run(metrics_port) == n


@pytest.fixture
def counted(start_worker) -> int:
    """One worker serving the tiny model, with its metrics on a port of its own; returns the port."""
    port = free_port()
    start_worker("w1", KVPOOL_METRICS_PORT=str(port), KVPOOL_N_CTX="4096")
    return port


def test_a_retry_with_the_same_key_and_body_gets_the_first_answer_from_one_job(counted, start_gateway, redis_url) -> None:
    g1, g2 = start_gateway(KVPOOL_N_CTX="4096"), start_gateway(KVPOOL_N_CTX="4096")
    body = {"model": MODEL, "prompt": prompt_text(40, 60), "max_tokens": 24, "temperature": 0}
    first = httpx.post(g1.url + "/v1/completions", json=body, headers={KEY: "retry-1"}, timeout=60)
    raw = json.dumps(dict(reversed(body.items())), indent=2)  # the same request, other whitespace and key order
    again = httpx.post(g2.url + "/v1/completions", content=raw, headers={KEY: "retry-1", "Content-Type": "application/json"}, timeout=60)
    assert first.status_code == again.status_code == 200, again.text
    a, b = first.json(), again.json()
    assert b["id"] == a["id"] and b["choices"] == a["choices"] and b["usage"] == a["usage"] and b["kvpool"] == a["kvpool"]
    assert outcomes(g1.url) == {"new": 1} and outcomes(g2.url) == {"attached": 1}
    assert_jobs(redis_url, counted, 1)


def test_gateways_racing_with_one_key_enqueue_one_job(counted, start_gateway, redis_url) -> None:
    gateways = [start_gateway(KVPOOL_N_CTX="4096"), start_gateway(KVPOOL_N_CTX="4096")]
    messages = [{"role": "user", "content": prompt_text(41, 30)}]
    start, answers = threading.Barrier(6), []

    def ask(i: int) -> None:
        start.wait()
        r = openai_client(gateways[i % 2]).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_headers={KEY: "race"}
        )
        answers.append(r)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 6
    assert len({r.id for r in answers}) == 1 and len({r.choices[0].message.content for r in answers}) == 1
    assert_jobs(redis_url, counted, 1)


def test_a_key_sent_with_another_body_is_a_409_and_a_bad_key_a_400(counted, start_gateway, redis_url) -> None:
    gw = start_gateway(KVPOOL_N_CTX="4096")
    client = openai_client(gw)
    messages = [{"role": "user", "content": "one"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_headers={KEY: "k1"})
    with pytest.raises(openai.ConflictError) as conflict:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, extra_headers={KEY: "k1"})
    err = conflict.value.body
    assert conflict.value.status_code == 409 and err["param"] == KEY and KEY in err["message"], err
    assert err["type"] == "invalid_request_error" and err["code"] == "idempotency_key_reused"
    with pytest.raises(openai.ConflictError):  # the same body on another endpoint is another request
        client.completions.create(model=MODEL, prompt="one", max_tokens=4, extra_headers={KEY: "k1"})

    body = {"model": MODEL, "prompt": "two", "max_tokens": 4}
    for bad in ("", "k" * 256):
        r = httpx.post(gw.url + "/v1/completions", json=body, headers={KEY: bad}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == KEY and KEY in r.json()["error"]["message"]
    assert httpx.post(gw.url + "/v1/completions", json=body, headers={KEY: "k" * 255}, timeout=60).status_code == 200
    assert_jobs(redis_url, counted, 2)


def test_one_tenants_keys_are_invisible_to_another(counted, start_gateway, redis_url) -> None:
    keys = json.dumps({"key-a": "team-a", "key-b": "team-b"})
    gw = start_gateway(KVPOOL_API_KEYS=keys, KVPOOL_N_CTX="4096")
    a, b = openai_client(gw, "key-a"), openai_client(gw, "key-b")
    ask = {"model": MODEL, "prompt": prompt_text(42, 20), "max_tokens": 8, "temperature": 0, "extra_headers": {KEY: "shared"}}
    first_a = a.completions.create(**ask)
    first_b = b.completions.create(**ask)
    assert first_b.id != first_a.id  # b's key is its own: a job of its own, not a's answer
    with pytest.raises(openai.ConflictError):  # b's record, not a's, holds the key for b
        b.completions.create(**{**ask, "max_tokens": 9})
    assert a.completions.create(**ask).id == first_a.id
    assert_jobs(redis_url, counted, 2)


@pytest.mark.serial  # a race of the client against the worker (the 5th token must arrive before the 300th is decoded)
def test_a_client_whose_gateway_was_killed_mid_stream_gets_the_whole_answer_from_another(counted, start_gateway, redis_url) -> None:
    """The scenario of a gateway that dies under its clients: the retry on the other gateway loses nothing, runs nothing twice."""
    g1, g2 = start_gateway(KVPOOL_N_CTX="4096"), start_gateway(KVPOOL_N_CTX="4096")
    ask = {"model": MODEL, "prompt": prompt_text(43, 40), "max_tokens": 300, **NO_EOS}
    uninterrupted = openai_client(g2).completions.create(**ask)
    assert_jobs(redis_url, counted, 1)

    key = {KEY: str(uuid.uuid4())}
    partial: list[str] = []
    with pytest.raises((httpx.HTTPError, openai.APIError)):
        for chunk in openai_client(g1).completions.create(**ask, stream=True, extra_headers=key):
            partial.append(chunk.choices[0].text)
            if len(partial) == 5:
                job_id = chunk.id.removeprefix("cmpl-")
                g1.kill()
                assert Job.fetch(job_id, connection=redis.Redis.from_url(redis_url)).get_status() == "started"  # mid-answer
    retried = list(openai_client(g2).completions.create(**ask, stream=True, extra_headers=key))
    text = "".join(c.choices[0].text for c in retried if c.choices)
    assert text == uninterrupted.choices[0].text and text.startswith("".join(partial))
    assert [c.choices[0].finish_reason for c in retried if c.choices and c.choices[0].finish_reason] == ["length"]
    assert {c.id for c in retried} == {"cmpl-" + job_id}
    assert outcomes(g2.url) == {"attached": 1}
    assert_jobs(redis_url, counted, 2)


def test_a_retry_after_its_client_left_runs_anew(counted, start_gateway, redis_url) -> None:
    """A client that leaves cancels its job, key or not; a cancelled answer is not replayed, so the retry runs again."""
    gw = start_gateway(KVPOOL_N_CTX="4096")
    ask = {"model": MODEL, "prompt": prompt_text(44, 30), "max_tokens": 300, **NO_EOS}
    with httpx.stream("POST", gw.url + "/v1/completions", json={**ask, "stream": True}, headers={KEY: "left"}, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    job_id = json.loads(first[6:])["id"].removeprefix("cmpl-")
    conn = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 30
    while not Job.fetch(job_id, connection=conn).is_finished:
        assert time.monotonic() < deadline, "the job went on after its client left"
        time.sleep(0.1)
    assert Job.fetch(job_id, connection=conn).return_value()["finish_reason"] == "cancelled"
    again = list(openai_client(gw).completions.create(**ask, stream=True, extra_headers={KEY: "left"}))
    assert again[0].id != "cmpl-" + job_id and outcomes(gw.url) == {"new": 1, "rerun": 1}
    assert [c.choices[0].finish_reason for c in again if c.choices and c.choices[0].finish_reason] == ["length"]
    assert_jobs(redis_url, counted, 2)


def test_a_retry_after_the_answer_expired_runs_anew(start_worker, start_gateway, redis_url) -> None:
    """Once the job's stream has expired (KVPOOL_STREAM_TTL_S after its last event) there is nothing to replay."""
    port = free_port()
    start_worker("w1", KVPOOL_METRICS_PORT=str(port), KVPOOL_STREAM_TTL_S="1")
    gw = start_gateway()
    ask = {"model": MODEL, "prompt": prompt_text(45, 30), "max_tokens": 12, "temperature": 0, "extra_headers": {KEY: "late"}}
    first = openai_client(gw).completions.create(**ask)
    conn = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 30
    while conn.exists(stream_key(first.id.removeprefix("cmpl-"))):
        assert time.monotonic() < deadline, "the job's stream did not expire"
        time.sleep(0.1)
    again = openai_client(gw).completions.create(**ask)
    assert again.id != first.id and again.choices[0].text == first.choices[0].text
    assert outcomes(gw.url) == {"new": 1, "rerun": 1}
    assert_jobs(redis_url, port, 2)


def test_a_retry_after_the_job_failed_runs_anew(start_worker, start_gateway, redis_url) -> None:
    """A worker whose context cannot hold the prompt refuses the job; a retry, once a worker that can is up, is answered."""
    small = start_worker("small", KVPOOL_N_CTX="128")
    gw = start_gateway()
    ask = {"model": MODEL, "prompt": prompt_text(46, 200), "max_tokens": 8, "temperature": 0, "extra_headers": {KEY: "failed"}}
    with pytest.raises(openai.InternalServerError) as failed:
        openai_client(gw).completions.create(**ask)
    assert failed.value.status_code == 502 and "does not fit the context" in str(failed.value)
    small.stop()
    start_worker("large")
    again = openai_client(gw).completions.create(**ask)
    assert again.model_extra["kvpool"]["worker"] == "large" and again.usage.completion_tokens == 8
    assert jobs_enqueued(redis_url) == 2 and outcomes(gw.url) == {"new": 1, "rerun": 1}


@pytest.mark.serial  # a wall-clock bound
def test_a_retry_attaches_to_the_job_of_a_gateway_killed_between_enqueueing_and_recording_it(counted, start_gateway, redis_url) -> None:
    """A claim names its jobs before they are enqueued. Here the record is put back to ``claimed``, as a gateway
    SIGKILLed after its enqueue and before its record leaves it: the retry attaches at once instead of waiting for
    the claim to expire and running the prompt a second time (chaos caught that: a job that answered nobody)."""
    from gateway.idempotency import record_key

    g1, g2 = start_gateway(KVPOOL_N_CTX="4096"), start_gateway(KVPOOL_N_CTX="4096")
    body = {"model": MODEL, "prompt": prompt_text(44, 60), "max_tokens": 16, "temperature": 0}
    first = httpx.post(g1.url + "/v1/completions", json=body, headers={KEY: "killed-gateway"}, timeout=60)
    assert first.status_code == 200, first.text
    conn = redis.Redis.from_url(redis_url)
    rkey = record_key("default", "killed-gateway")
    record = json.loads(conn.get(rkey) or b"{}")
    assert record["state"] == "submitted" and len(record["jobs"]) == 1
    conn.set(rkey, json.dumps({**record, "state": "claimed"}), px=60_000)  # as the killed gateway left it
    t0 = time.monotonic()
    again = httpx.post(g2.url + "/v1/completions", json=body, headers={KEY: "killed-gateway"}, timeout=90)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"] and again.json()["choices"] == first.json()["choices"]
    assert time.monotonic() - t0 < 10, "attached at once, not after the claim expired"
    assert outcomes(g2.url) == {"attached": 1}
    assert_jobs(redis_url, counted, 1)
