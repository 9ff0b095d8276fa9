"""The official openai client against a gateway with two real workers, real redis-server and S3 over HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import llama_cpp
import pytest

from gateway.dispatch import RouteReason
from tests.helpers import (
    MODEL,
    POOL_CHUNK,
    SharedPool,
    Tenancy,
    cold_greedy,
    counter,
    openai_client,
    prompt_text,
    shared_pool,
    wait_settled,
)


@pytest.fixture(scope="module")
def two_workers(s3_server, tiny_model, tmp_path_factory) -> Iterator[SharedPool]:
    with shared_pool(s3_server, tiny_model, tmp_path_factory.mktemp("openai"), ["w1", "w2"]) as shared:
        yield shared


@pytest.fixture
def pool(two_workers: SharedPool) -> Tenancy:
    """Two workers and a gateway shared by the module; each test a tenant of its own."""
    return two_workers.tenancy()


@pytest.mark.fp_path
def test_completions_with_a_shared_prefix_report_cached_tokens_and_match_a_cold_run(pool, tiny_model, cold_llm) -> None:
    client = openai_client(pool)
    document = prompt_text(20, 200)
    first = client.completions.create(model=MODEL, prompt=document + " first question", max_tokens=20, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    wait_settled(pool.redis_url)  # publishing runs in the background after the answer

    second = client.completions.create(model=MODEL, prompt=document + " another question", max_tokens=20, temperature=0, seed=3)
    vocab = llama_cpp.Llama(str(tiny_model), vocab_only=True, verbose=False)
    tokens = vocab.tokenize((document + " another question").encode())
    first_tokens = vocab.tokenize((document + " first question").encode())
    shared = next(i for i, (a, b) in enumerate(zip(tokens, first_tokens)) if a != b)
    assert second.usage.prompt_tokens_details.cached_tokens >= shared // POOL_CHUNK * POOL_CHUNK > 0
    expected = vocab.detokenize(cold_greedy(cold_llm, tokens, 20)).decode("utf-8", "replace")
    assert second.choices[0].text == expected
    assert second.choices[0].finish_reason in ("length", "stop")


def test_sampling_with_a_seed_is_the_same_restored_or_cold(pool) -> None:
    client = openai_client(pool)
    prompt = prompt_text(21, 180)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.9, seed=1234)
    cold = client.completions.create(**kwargs)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    wait_settled(pool.redis_url)
    warm = [client.completions.create(**kwargs) for _ in range(2)]
    assert all(w.usage.prompt_tokens_details.cached_tokens > 0 for w in warm)
    assert [w.choices[0].text for w in warm] == [cold.choices[0].text] * 2


def test_streaming_completion_matches_the_whole_one(pool) -> None:
    client = openai_client(pool)
    prompt = prompt_text(22, 60)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    pieces = []
    usage = None
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == whole.choices[0].text
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_chat_and_streamed_chat(pool) -> None:
    client = openai_client(pool)
    messages = [{"role": "system", "content": prompt_text(23, 80)}, {"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens > 80
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert "<|im_end|>" not in text


def test_multi_turn_chat_is_served_from_cache(pool) -> None:
    client = openai_client(pool)
    messages = [{"role": "system", "content": prompt_text(24, 150)}, {"role": "user", "content": "First question?"}]
    r1 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    wait_settled(pool.redis_url)
    messages += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "And then?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= (r1.usage.prompt_tokens // POOL_CHUNK) * POOL_CHUNK


def test_logprobs(pool) -> None:
    client = openai_client(pool)
    r = client.completions.create(model=MODEL, prompt=prompt_text(25, 20), max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    c = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    assert len(c.choices[0].logprobs.content) == 4
    assert all(len(t.top_logprobs) == 2 for t in c.choices[0].logprobs.content)


def test_models_health_and_readiness(pool) -> None:
    client = openai_client(pool)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(pool.url + "/healthz").json() == {"status": "ok"}
    ready = pool.get("/readyz").json()
    assert ready["status"] == "ready" and ready["checks"]["workers"] == 2
    served = counter(pool.url, "kvpool_gateway_requests_total", endpoint="/v1/completions", status="200")
    routed = sum(counter(pool.url, "kvpool_gateway_routed_total", reason=r) for r in RouteReason)
    client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert counter(pool.url, "kvpool_gateway_requests_total", endpoint="/v1/completions", status="200") == served + 1
    assert sum(counter(pool.url, "kvpool_gateway_routed_total", reason=r) for r in RouteReason) == routed + 1
    assert counter(pool.url, "kvpool_gateway_tenant_requests_total", tenant=pool.api_key.replace("sk-", "")) == 1
