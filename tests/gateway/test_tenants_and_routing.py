"""Tenants never share cache entries; requests go to the worker that holds their prefix when it is free."""

from __future__ import annotations

import json
import threading

import httpx
import llama_cpp
import pytest

from tests.helpers import MODEL, cold_greedy, openai_client, prompt_text, wait_settled

KEYS = {"key-a1": "team-a", "key-a2": "team-a", "key-b": "team-b"}


def test_tenants_do_not_share_cache_and_keys_of_one_tenant_do(start_worker, start_gateway, redis_url) -> None:
    start_worker("w1")
    gw = start_gateway(KVPOOL_API_KEYS=json.dumps(KEYS), KVPOOL_TENANT_SECRET="test-secret")
    prompt = prompt_text(30, 200)

    def cached(key: str) -> int:
        r = openai_client(gw, key).completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        wait_settled(redis_url)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("key-a1") == 0
    assert cached("key-b") == 0, "another tenant must not hit team-a's cache, not even the worker's own context"
    assert cached("key-a2") > 0, "keys of one tenant share its cache"
    assert cached("key-b") > 0


def test_missing_or_wrong_key_is_401(start_worker, start_gateway) -> None:
    start_worker("w1")
    gw = start_gateway(KVPOOL_API_KEYS=json.dumps(KEYS))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic key-a1"}):
        r = httpx.post(gw.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(gw.url + "/v1/models").status_code == 401
    ok = httpx.post(gw.url + "/v1/completions", json=body, headers={"Authorization": "Bearer key-b"})
    assert ok.status_code == 200


@pytest.mark.fp_path
def test_a_follow_up_goes_to_the_holder_when_free_and_elsewhere_when_busy(
    start_worker, start_gateway, tiny_model, cold_llm, redis_url
) -> None:
    start_worker("w1", KVPOOL_N_CTX="4096")
    start_worker("w2", KVPOOL_N_CTX="4096")
    gw = start_gateway(KVPOOL_N_CTX="4096")
    client = openai_client(gw)
    vocab = llama_cpp.Llama(str(tiny_model), vocab_only=True, verbose=False)
    history = prompt_text(31, 250)

    first = client.completions.create(model=MODEL, prompt=history, max_tokens=8, temperature=0)
    holder = first.model_extra["kvpool"]["worker"]
    other = ({"w1", "w2"} - {holder}).pop()
    wait_settled(redis_url)

    follow = history + first.choices[0].text + " and next"
    free = client.completions.create(model=MODEL, prompt=follow, max_tokens=8, temperature=0)
    assert free.model_extra["kvpool"]["worker"] == holder
    assert free.model_extra["kvpool"]["cached_from_context"] > 0
    wait_settled(redis_url)

    busy_started = threading.Event()

    def occupy_holder() -> None:
        stream = client.completions.create(model=MODEL, prompt=follow, max_tokens=3500, temperature=0, logit_bias={"2": -100}, stream=True)
        for _ in stream:
            busy_started.set()

    t = threading.Thread(target=occupy_holder)
    t.start()
    assert busy_started.wait(30)
    follow2 = follow + free.choices[0].text + " then"
    routed = client.completions.create(model=MODEL, prompt=follow2, max_tokens=8, temperature=0)
    t.join()
    assert routed.model_extra["kvpool"]["worker"] == other
    assert routed.model_extra["kvpool"]["cached_from_store"] > 0
    expected = vocab.detokenize(cold_greedy(cold_llm, vocab.tokenize(follow2.encode()), 8)).decode("utf-8", "replace")
    assert routed.choices[0].text == expected

    metrics = httpx.get(gw.url + "/metrics").text
    assert 'kvpool_gateway_routed_total{reason="locality"}' in metrics
    assert 'kvpool_gateway_routed_total{reason="holder_busy"}' in metrics
