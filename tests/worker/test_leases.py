"""Coalescing: a prefix that several workers need at once is evaluated by one of them.

Leases on a real redis-server: claiming is atomic and names each chunk's holder, a
held lease is renewed and one whose holder stopped expires, a worker releases only
its own. Then real worker processes: two workers given the same new documents at once
evaluate each document once, and a lease left behind by a holder that died delays no
job past its expiry.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import redis

from store.backends.fs import FsBackend
from store.index import RedisIndex
from store.store import Store
from tests.helpers import POOL_CHUNK, PoolClient, prompt_text
from worker.answering import Engine
from worker.cache.leases import EvalRate, Leases, leased_by_others
from worker.cache.namespace import namespace_for
from worker.errors import JobAborted
from worker.protocol import SamplingParams, job_spec, lease_key
from worker.settings import WorkerSettings

KEYS = [bytes([i]) * 16 for i in range(4)]


def test_claiming_is_atomic_and_names_each_holder(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    a, b = Leases(conn, "a", lease_s=30), Leases(conn, "b", lease_s=30)
    try:
        claim_a, holders = a.claim(KEYS[:2])
        assert holders == ["a", "a"] and len(claim_a.keys) == 2
        claim_b, holders = b.claim(KEYS)
        assert holders == ["a", "a", "b", "b"], "b gets only what nobody held"
        assert leased_by_others(holders, "b") == 2 and leased_by_others(holders, "a") == 0
        conn.set(lease_key(KEYS[1]), "b")  # as if a's lease on it had expired and b had taken it
        a.release(claim_a)
        assert conn.get(lease_key(KEYS[0])) is None, "a released its own lease"
        assert conn.get(lease_key(KEYS[1])) == b"b", "a late release frees nothing that is no longer a's"
    finally:
        a.close()
        b.close()


def test_a_held_lease_is_renewed_and_one_whose_holder_stopped_expires(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    holder = Leases(conn, "holder", lease_s=0.3)
    holder.claim(KEYS[:1])
    name = lease_key(KEYS[0])
    until = time.monotonic() + 1.5  # five lease periods
    while time.monotonic() < until:
        assert conn.exists(name), "a lease that is renewed never lapses"
        time.sleep(0.02)
    holder._stop.set()  # the holder stalls: nothing renews its lease any more
    holder._thread.join()
    deadline = time.monotonic() + 5
    while conn.exists(name):
        assert time.monotonic() < deadline, "the lease of a stalled holder did not expire"
        time.sleep(0.02)


def test_a_waiter_returns_once_the_lease_is_gone_or_at_its_own_bound(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    a, b = Leases(conn, "a", lease_s=30), Leases(conn, "b", lease_s=30)
    try:
        claim, _ = a.claim(KEYS[:1])
        assert b.wait(KEYS[:1], max_wait_s=0.05) == "timeout"
        a.release(claim)
        assert b.wait(KEYS[:1], max_wait_s=30) == "released"
    finally:
        a.close()
        b.close()


def test_the_wait_is_bounded_by_how_long_evaluating_alone_would_take() -> None:
    rate = EvalRate()
    assert rate.seconds_for(1000, default_s=5.0) == 5.0, "no rate seen yet: the lease bounds the wait"
    rate.observe(2000, 1.0)
    rate.observe(10, 1.0)  # too few tokens to say anything
    assert rate.seconds_for(1000, default_s=5.0) == 0.5


def _documents(n_docs: int, doc_len: int, questions: int, q_len: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    prompts = []
    for _ in range(n_docs):
        doc = rng.integers(10, 1000, doc_len).tolist()
        for q in range(questions):
            prompts.append(doc + [1000 + q] + rng.integers(10, 1000, q_len - 1).tolist())
    return prompts


def test_two_workers_given_the_same_new_documents_at_once_evaluate_each_once(start_worker, client: PoolClient) -> None:
    """4 documents x 4 questions, sent 16 at once: the pool evaluates each document once, plus the questions.

    The workers wait for each other's publish however quick evaluating alone would be
    (``KVPOOL_LEASE_WAIT_MIN_S``), so what is evaluated does not depend on the machine's speed.
    """
    start_worker("w1", KVPOOL_LEASE_WAIT_MIN_S="60")
    start_worker("w2", KVPOOL_LEASE_WAIT_MIN_S="60")
    doc_len, q_len = 9 * POOL_CHUNK + 2, 12  # each prompt's last chunk is partial: its tail serves the other questions
    prompts = _documents(4, doc_len, 4, q_len)
    jobs = [client.submit(client.spec(p, max_tokens=2)) for p in prompts]
    results = [client.collect(j).result for j in jobs]
    assert all(r is not None for r in results)
    evaluated = sum(r.usage.evaluated_tokens for r in results if r)
    minimum = 4 * doc_len + 16 * q_len
    assert evaluated <= 1.1 * minimum, f"{evaluated} tokens evaluated, the minimum is {minimum}"
    assert {r.worker for r in results if r} == {"w1", "w2"}, "both workers took jobs"


def test_a_lease_left_by_a_dead_holder_delays_no_job_past_its_expiry(start_worker, client: PoolClient) -> None:
    """A holder that died mid-prefix leaves its leases; the next worker evaluates alone once they expire."""
    start_worker("w1", KVPOOL_LEASE_S="1")
    prompt = _documents(1, 6 * POOL_CHUNK, 1, 8)[0]
    ns_keys = namespace_for(client.settings, client.fingerprint).chain(prompt)  # leases are on the blob chain
    conn = client.conn
    for k in ns_keys:
        conn.set(lease_key(k), "dead-worker", px=1500)
    result = client.run(prompt, max_tokens=2)
    assert result.usage.evaluated_tokens == len(prompt), "nobody published: the worker evaluated it all itself"
    assert result.timings.lease_wait_s > 0, "it waited for the dead holder first"
    deadline = time.monotonic() + 20
    while any(conn.exists(lease_key(k)) for k in ns_keys):
        assert time.monotonic() < deadline, "its own leases were not released after its publish"
        time.sleep(0.02)
    assert client.conn.exists(*[f"kvpool:v1:chunk:{k.hex()}" for k in ns_keys]) == len(ns_keys), "it published the prefix"


def test_a_prefix_search_that_raises_after_leasing_leaves_no_lease_behind(
    tiny_model: Path, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job never starts, so nothing else would release its leases: a live worker would renew them for its whole life."""
    conn = redis.Redis.from_url(redis_url)
    store = Store(FsBackend(tmp_path / "blobs"), RedisIndex.from_url(redis_url))
    settings = WorkerSettings(chunk_size=POOL_CHUNK, n_ctx=512, n_threads=1, parallel=1, self_check=False, lease_s=0.3)
    engine = Engine.open(settings, tiny_model, store=store, name="leaser")
    try:
        assert engine.leases is not None
        tokens = engine.llm.tokenize(prompt_text(71, 150).encode())
        spec = job_spec(tokens, model=engine.fingerprint, chunk_size=POOL_CHUNK, sampling=SamplingParams(max_tokens=1, temperature=0.0))

        def broken(plan: object) -> None:
            assert conn.keys("kvpool:lease:*"), "the search had leased the chunks it would evaluate"
            raise RuntimeError("the prefix search failed")

        monkeypatch.setattr(engine.finder, "_report", broken)
        with pytest.raises(RuntimeError, match="prefix search failed"):
            engine.run(spec, lambda ev: True)
        assert conn.keys("kvpool:lease:*") == [], "released at once"
        assert engine.leases._claims == [], "nothing renews them either"
    finally:
        engine.close()
        store.close()


def test_a_wait_for_a_lease_ends_when_the_job_is_cancelled(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    holder, waiter = Leases(conn, "holder", lease_s=30), Leases(conn, "waiter", lease_s=30)
    try:
        holder.claim(KEYS[:1])
        asked: list[float] = []

        def watch() -> str | None:
            asked.append(time.monotonic())
            return "cancelled by the client" if len(asked) > 3 else None

        with pytest.raises(JobAborted, match="cancelled"):
            waiter.wait(KEYS[:1], max_wait_s=600, watch=watch)
        assert len(asked) == 4 and conn.exists(lease_key(KEYS[0])), "the holder's lease stands; the waiter gave up"
    finally:
        holder.close()
        waiter.close()
