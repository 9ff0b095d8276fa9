"""Worker processes on a real S3 server (SeaweedFS) that is killed and started again while they answer."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from gateway.pool.s3server import S3Server
from store.store import Store
from tests.helpers import POOL_CHUNK, PoolClient, cold_greedy, poll, prompt_text, s3_settings
from tests.worker.test_pool import wait_published
from worker.cache.namespace import namespace_for

pytestmark = pytest.mark.fp_path  # answers are compared with a cold run, token for token


def test_s3_killed_and_restarted_under_load_loses_no_answer_and_no_blob(start_worker, redis_url, tiny_model, cold_llm) -> None:
    s3 = S3Server().start()
    settings = s3_settings(s3.endpoint_url, "kvpool-restarts", redis_url)
    env = {"KVPOOL_STORE_URL": settings.store_url, "KVPOOL_S3_ENDPOINT_URL": s3.endpoint_url}
    try:
        w1 = start_worker("w1", **env)
        w2 = start_worker("w2", **env)
        client = PoolClient(redis.Redis.from_url(redis_url), tiny_model)
        kept = client.tokens(prompt_text(7, 150))
        client.run(kept, worker="w1")
        wait_published(client, kept, len(kept) // POOL_CHUNK)

        prompts = [client.tokens(prompt_text(20 + i, 60)) for i in range(8)]
        with ThreadPoolExecutor(2) as load:
            answers = [load.submit(client.run, p, worker=("w1", "w2")[i % 2]) for i, p in enumerate(prompts)]
            answers[1].result(timeout=120)
            s3.kill()  # SIGKILL, with jobs queued and running
            answers[4].result(timeout=120)
            deadline = time.monotonic() + 60
            while "publish.failed" not in w1.log() + w2.log():  # publishing meets the dead server
                assert time.monotonic() < deadline, "no publish met the dead server"
                time.sleep(0.1)
            s3.start()
            results = [a.result(timeout=120) for a in answers]
        for p, r in zip(prompts, results):
            assert r.tokens == cold_greedy(cold_llm, p, 24)

        # A restarted server may answer a read with an error for a moment after it is up; w2 would then
        # evaluate and hold the prompt in its own cells. Wait until the store serves every kept chunk.
        ns = namespace_for(client.settings, client.fingerprint)
        keys = ns.chain(kept)
        with Store.open(settings) as store:
            poll(lambda: len(store.fetch(ns, kept, keys, 0, len(keys))) == len(keys), "the restarted server to serve what was kept")
        again = kept + client.tokens(" once more")
        r = client.run(again, worker="w2")
        assert r.usage.cached_from_store >= (len(kept) // POOL_CHUNK) * POOL_CHUNK, "what was stored before the kill is there"
        assert r.tokens == cold_greedy(cold_llm, again, 24)
    finally:
        s3.stop()
