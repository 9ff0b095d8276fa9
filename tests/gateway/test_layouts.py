"""One pool, several KV layouts: the gateway routes by layout-free prefix keys, and each worker keeps its own blobs.

A default gateway in front of an f16 worker and a q8_0 (flash attention) worker serves
long prompts on both; each worker restores only from blobs of its own layout. A gateway
whose own settings name another layout still works, since it never needs the workers'
layout. What a pool must agree on (the model, the chunk size) is checked by `/readyz`
and refused by name at dispatch.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from store.index import RedisIndex
from tests.helpers import MODEL, POOL_CHUNK, PoolClient, openai_client, prompt_text, wait_settled
from worker.cache.namespace import namespace_for
from worker.settings import WorkerSettings

Q8 = {"KVPOOL_TYPE_K": "q8_0", "KVPOOL_TYPE_V": "q8_0", "KVPOOL_FLASH_ATTN": "true"}


def test_a_default_gateway_serves_long_prompts_on_workers_of_two_layouts(start_worker, start_gateway, redis_url, tiny_model) -> None:
    start_worker("f16")
    start_worker("q8", **Q8)
    gw = start_gateway(KVPOOL_FLASH_ATTN="true")  # the gateway's own layout settings play no part
    ready = httpx.get(f"{gw.url}/readyz", timeout=10).json()
    assert ready["checks"]["workers"] == 2 and len(ready["checks"]["layouts"]) == 2, ready

    client = openai_client(gw)
    prompts = [prompt_text(40 + i, 12 * POOL_CHUNK) for i in range(6)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0), prompts))
    assert all(a.usage.prompt_tokens >= 8 * POOL_CHUNK and a.choices[0].text for a in answers), "every long prompt answered"

    # Each layout in turn, through its worker's own queue: long prompts served, restored from its own blobs.
    pool_client = PoolClient(redis.Redis.from_url(redis_url), tiny_model)
    tokens = pool_client.tokens(prompt_text(60, 10 * POOL_CHUNK))
    for worker, env in (("f16", {}), ("q8", Q8)):
        pool_client.run([5, 6, 7], worker=worker, tenant="elsewhere")  # the worker empties its context
        pool_client.run(tokens, worker=worker)
        wait_settled(redis_url)  # its chunks and tail are published in the background
        pool_client.run([5, 6, 7], worker=worker, tenant="elsewhere")
        again = pool_client.run(tokens + [9, 9, 9], worker=worker)
        assert again.usage.cached_from_store >= len(tokens) - 2, f"{worker} restored from its own layout's blobs"
        settings = WorkerSettings(chunk_size=POOL_CHUNK, **{k.removeprefix("KVPOOL_").lower(): v for k, v in env.items()})
        keys = namespace_for(settings, pool_client.fingerprint).chain(tokens)
        assert RedisIndex(pool_client.conn).deepest(keys) == len(keys), f"{worker}'s layout has its own blobs"


def test_a_gateway_and_workers_that_disagree_on_the_chunk_size_say_so(start_worker, start_gateway) -> None:
    start_worker("w1")
    gw = start_gateway(KVPOOL_CHUNK_SIZE=str(2 * POOL_CHUNK))
    ready = httpx.get(f"{gw.url}/readyz", timeout=10)
    assert ready.status_code == 503 and "chunk size" in ready.json()["checks"]["workers"]
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_matching_worker"
    assert "KVPOOL_CHUNK_SIZE" in r.json()["error"]["message"]
