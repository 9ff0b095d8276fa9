"""OpenAI's ``prompt_cache_key``: a burst of requests that share a new prefix and a key lands on one worker, which evaluates the prefix once."""

from __future__ import annotations

import threading

import httpx

from tests.helpers import MODEL, openai_client, prompt_text

N = 4


def burst(client, prefix: str, **extra) -> list:  # noqa: ANN001
    """``N`` completions sharing ``prefix``, sent at the same moment."""
    start = threading.Barrier(N)
    out: list = [None] * N

    def one(i: int) -> None:
        start.wait()
        out[i] = client.completions.create(model=MODEL, prompt=f"{prefix} question {i}", max_tokens=4, temperature=0, **extra)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_burst_with_a_prompt_cache_key_lands_on_one_worker(start_worker, start_gateway) -> None:
    start_worker("w1")
    start_worker("w2")
    gw = start_gateway()
    client = openai_client(gw)

    keyed = burst(client, prompt_text(51, 1200), extra_body={"prompt_cache_key": "handbook-v1"})
    assert len({r.model_extra["kvpool"]["worker"] for r in keyed}) == 1
    assert sum(r.model_extra["kvpool"]["evaluated_tokens"] for r in keyed) < 2 * keyed[0].usage.prompt_tokens  # the prefix once

    spread = burst(client, prompt_text(52, 1200))  # the same burst without a key goes to whichever worker is free
    assert len({r.model_extra["kvpool"]["worker"] for r in spread}) == 2

    metrics = httpx.get(gw.url + "/metrics").text
    assert f'kvpool_gateway_routed_total{{reason="cache_key"}} {float(N)}' in metrics


def test_every_api_accepts_a_prompt_cache_key(start_worker, start_gateway) -> None:
    start_worker("w1")
    gw = start_gateway()
    client = openai_client(gw)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, prompt_cache_key="k", temperature=0
    )
    response = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, prompt_cache_key="k", temperature=0)
    assert chat.choices[0].message.content is not None and response.prompt_cache_key == "k"
    too_long = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "prompt_cache_key": "k" * 2000})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt_cache_key"
