"""A job retried after its worker died mid-answer gives the client one answer: the retry's, never two joined."""

from __future__ import annotations

import time

import redis

from tests.helpers import MODEL, PoolClient, openai_client
from worker.advert import adverts


def _kill_the_busy_one(workers: dict, conn: redis.Redis) -> str:
    deadline = time.monotonic() + 30
    while not (busy := [a.worker for a in adverts(conn) if a.busy]):
        assert time.monotonic() < deadline, "no worker took the job"
        time.sleep(0.02)
    workers[busy[0]].kill()
    return busy[0]


def test_a_sampled_answer_without_a_seed_survives_its_worker_dying(start_worker, start_gateway, redis_url, tiny_model) -> None:
    """The gateway gives a seedless sampled job a seed of its own, so the retry samples the tokens the client already has."""
    workers = {n: start_worker(n, KVPOOL_N_CTX="4096") for n in ("w1", "w2")}
    gw = start_gateway(KVPOOL_N_CTX="4096")
    conn = redis.Redis.from_url(redis_url)
    client = openai_client(gw)
    stream = client.completions.create(
        model=MODEL, prompt="tell me more", stream=True, temperature=1.0, max_tokens=300, logit_bias={"2": -100}
    )
    got, job_id, killed = [], "", ""
    for chunk in stream:
        job_id = chunk.id.removeprefix("cmpl-")
        got.append(chunk.choices[0].text if chunk.choices else "")
        if len(got) == 5:
            killed = _kill_the_busy_one(workers, conn)
    retried = PoolClient(conn, tiny_model).collect(job_id, timeout_s=5)  # the job's stream, every attempt in it
    assert killed and len(retried.starts) == 2, retried.starts
    assert retried.result is not None and retried.result.usage.completion_tokens == 300
    assert "".join(got) == retried.streamed_text, "the client's answer is the retry's whole answer"
