"""Worker processes sharing prompt state through the store: real redis-server, S3 over HTTP, the generated model."""

from __future__ import annotations

import time
import urllib.request

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from gateway.pool.s3server import S3Server
from store.blob import BlobName
from store.index import RedisIndex
from tests.helpers import POOL_CHUNK, PoolClient, cold_greedy, poll, prompt_text, s3_client, s3_settings
from worker.cache.namespace import namespace_for
from worker.client import cancel

C = POOL_CHUNK

pytestmark = pytest.mark.fp_path  # answers are compared with a cold run, bit for bit or token for token


def wait_published(client: PoolClient, tokens: list[int], chunks: int, tenant: str = "", timeout_s: float = 20.0) -> None:
    """Publishing runs in the background after the answer; wait until the index holds ``chunks`` chunks."""
    keys = namespace_for(client.settings, client.fingerprint, tenant).chain(tokens)
    index = RedisIndex(client.conn)
    deadline = time.monotonic() + timeout_s
    while index.deepest(keys) < chunks:
        assert time.monotonic() < deadline, f"only {index.deepest(keys)} of {chunks} chunks published"
        time.sleep(0.05)


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_a_second_worker_restores_what_the_first_published(start_worker, client, cold_llm) -> None:
    start_worker("w1")
    w2 = start_worker("w2")
    prefix = client.tokens(prompt_text(1, 160))
    first_prompt = prefix + client.tokens(" what does the river say")
    first = client.run(first_prompt, worker="w1")
    assert first.worker == "w1" and first.usage.cached_tokens == 0
    assert first.tokens == cold_greedy(cold_llm, first_prompt, 24)
    wait_published(client, first_prompt, len(first_prompt) // C)

    second_prompt = prefix + client.tokens(" and where is the harbor lantern")
    second = client.run(second_prompt, worker="w2")
    assert second.worker == "w2"
    assert second.usage.cached_from_store == lcp(first_prompt, second_prompt) > 0, "resumed where the prompts part"
    assert second.usage.cached_from_context == 0
    assert second.usage.evaluated_tokens == len(second_prompt) - second.usage.cached_tokens
    assert second.tokens == cold_greedy(cold_llm, second_prompt, 24)
    assert second.timings.restore_s > 0 and second.timings.fetch_s > 0
    assert second.restore_choice == "unmeasured", "its first restore: nothing measured yet to weigh it against"
    done = f"cached_store={second.usage.cached_from_store} restore_choice=unmeasured"
    poll(lambda: any(" job.done " in line and done in line for line in w2.log().splitlines()), "the decision in w2's job.done line")


def test_the_same_worker_reuses_its_own_context_first(start_worker, client, cold_llm) -> None:
    start_worker("w1")
    prompt = client.tokens(prompt_text(2, 120))
    client.run(prompt, worker="w1")
    again = client.run(prompt + client.tokens(" more"), worker="w1")
    assert again.usage.cached_from_context >= len(prompt) - 1
    assert again.usage.cached_from_store == 0
    assert again.tokens == cold_greedy(cold_llm, prompt + client.tokens(" more"), 24)


def test_a_three_turn_chat_is_served_from_the_store_by_other_workers(start_worker, client, cold_llm) -> None:
    for name in ("w1", "w2", "w3"):
        start_worker(name)
    history = client.tokens("<|im_start|>user\n" + prompt_text(3, 90) + "<|im_end|>\n<|im_start|>assistant\n")
    results = []
    for turn, worker in enumerate(["w1", "w2", "w3"]):
        r = client.run(history, worker=worker, max_tokens=40)
        assert r.tokens == cold_greedy(cold_llm, history, 40), f"turn {turn + 1} differs from a cold run"
        results.append(r)
        held = history + r.tokens[:-1]
        wait_published(client, held, len(held) // C)
        history = (
            history
            + r.tokens
            + client.tokens("<|im_end|>\n<|im_start|>user\n" + prompt_text(10 + turn, 30) + "<|im_end|>\n<|im_start|>assistant\n")
        )
    assert [r.worker for r in results] == ["w1", "w2", "w3"]
    for r in results[1:]:
        assert r.usage.cached_from_store >= 0.6 * r.usage.prompt_tokens, r.usage
        assert r.usage.cached_from_context == 0


def test_a_corrupted_blob_is_not_loaded_and_the_answer_is_still_right(start_worker, client, cold_llm, store_settings_s3) -> None:
    start_worker("w1")
    w2 = start_worker("w2")
    prompt = client.tokens(prompt_text(4, 200))
    client.run(prompt, worker="w1")
    n_chunks = len(prompt) // C
    wait_published(client, prompt, n_chunks)

    ns = namespace_for(client.settings, client.fingerprint)
    keys = ns.chain(prompt)
    bucket, _, prefix = store_settings_s3.store_url.removeprefix("s3://").partition("/")
    s3 = s3_client(store_settings_s3)
    object_key = f"{prefix}/{BlobName(ns.key, 2, keys[2])}"
    blob = bytearray(s3.get_object(Bucket=bucket, Key=object_key)["Body"].read())
    blob[-100] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=object_key, Body=bytes(blob))

    r = client.run(prompt, worker="w2")
    assert r.usage.cached_from_store == 2 * C
    assert r.tokens == cold_greedy(cold_llm, prompt, 24)
    assert "chunk.rejected" in w2.log()
    s3.head_object(Bucket=bucket, Key=f"{prefix}/quarantine/{BlobName(ns.key, 2, keys[2])}")


def test_with_s3_stopped_answers_still_come_cold(start_worker, redis_url, tiny_model, cold_llm) -> None:
    s3 = S3Server().start()
    settings = s3_settings(s3.endpoint_url, "kvpool-down", redis_url)
    env = {"KVPOOL_STORE_URL": settings.store_url, "KVPOOL_S3_ENDPOINT_URL": s3.endpoint_url}
    try:
        start_worker("w1", **env)
        w2 = start_worker("w2", **env)
        client = PoolClient(redis.Redis.from_url(redis_url), tiny_model)
        prompt = client.tokens(prompt_text(5, 150))
        client.run(prompt, worker="w1")
        wait_published(client, prompt, len(prompt) // C)
        s3.stop()
        r = client.run(prompt + client.tokens(" again"), worker="w2")
        assert r.usage.cached_from_store == 0 and r.usage.evaluated_tokens == r.usage.prompt_tokens
        assert r.tokens == cold_greedy(cold_llm, prompt + client.tokens(" again"), 24)
        assert "fetch.unavailable" in w2.log()
    finally:
        s3.stop()


def long_job_prompt(client: PoolClient) -> list[int]:
    return client.tokens(prompt_text(6, 40))


NO_EOS = {"logit_bias": {2: -100.0}, "max_tokens": 3000}


def test_a_worker_killed_mid_job_leaves_the_job_to_another(start_worker, client, cold_llm) -> None:
    w1 = start_worker("w1", KVPOOL_N_CTX="4096")
    start_worker("w2", KVPOOL_N_CTX="4096")
    prompt = long_job_prompt(client)
    job_id = client.submit(client.spec(prompt, **NO_EOS), worker="w1")
    from worker.client import events

    seen = 0
    for ev in events(client.conn, job_id, timeout_s=60):
        if ev.type == "token":
            seen += 1
            if seen == 20:
                w1.kill()
                break
    out = client.collect(job_id, timeout_s=120)
    assert out.result is not None, out.error
    assert out.result.worker == "w2"
    assert [s.worker for s in out.starts][-1] == "w2" and out.starts[-1].attempt == 2
    assert out.result.usage.completion_tokens == 3000 - len(prompt) or out.result.finish_reason == "length"


def test_cancellation_stops_at_the_next_stream_write_and_every_token_made_was_streamed(start_worker, client) -> None:
    start_worker("w1", KVPOOL_N_CTX="4096")
    job_id = client.submit(client.spec(long_job_prompt(client), **NO_EOS), worker="w1")
    from worker.client import events

    seen = 0
    for ev in events(client.conn, job_id, timeout_s=60):
        if ev.type == "token":
            seen += 1
            if seen == 10:
                cancel(client.conn, job_id)
                break
    out = client.collect(job_id)
    assert out.result is not None and out.result.finish_reason == "cancelled"
    assert out.result.usage.completion_tokens <= len(out.tokens) + 2


def test_a_job_whose_keys_disagree_with_its_tokens_is_refused_not_retried(start_worker, client) -> None:
    start_worker("w1")
    tokens = client.tokens(prompt_text(7, 80))
    bad = client.spec(tokens, chain=["00" * 16] * (len(tokens) // C))
    out = client.collect(client.submit(bad, worker="w1"))
    assert out.result is None and out.error is not None and not out.error.retrying
    assert "prefix keys disagree" in out.error.error
    assert len(out.starts) == 1
    ok = client.run(tokens, worker="w1")
    assert ok.usage.prompt_tokens == len(tokens)


def test_sigterm_finishes_the_current_job_then_exits(start_worker, client) -> None:
    w1 = start_worker("w1", KVPOOL_N_CTX="4096")
    job_id = client.submit(client.spec(long_job_prompt(client), **{**NO_EOS, "max_tokens": 1500}), worker="w1")
    from worker.client import events

    for ev in events(client.conn, job_id, timeout_s=60):
        if ev.type == "token":
            w1.proc.send_signal(15)
            break
    out = client.collect(job_id)
    assert out.result is not None and out.result.finish_reason == "length" and out.result.usage.completion_tokens == 1500
    assert w1.proc.wait(timeout=30) == 0


def test_worker_metrics(start_worker, client) -> None:
    from gateway.pool.procs import free_port

    port = free_port()
    start_worker("w1", KVPOOL_METRICS_PORT=str(port))
    prompt = client.tokens(prompt_text(8, 100))
    client.run(prompt, worker="w1")
    client.run(prompt, worker="w1")

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels.get("le")}

    deadline = time.monotonic() + 10
    while (samples := scrape())["kvpool_worker_busy"] != 0:  # the job ends a moment after its answer
        assert time.monotonic() < deadline, "the worker still reports itself busy"
        time.sleep(0.05)
    assert samples["kvpool_worker_prompt_tokens_total"] == 2 * len(prompt)
    assert samples["kvpool_worker_reused_tokens_total"] == len(prompt) - 2  # the last two are always evaluated
    assert samples["kvpool_worker_restore_enabled"] == 1
    assert samples["kvpool_worker_exact_reuse"] == 1
    assert samples["kvpool_worker_busy"] == 0
    assert samples["kvpool_worker_generated_tokens_total"] > 0
