"""``cache_control`` keeps a prefix: published at once (even when no answer comes), pinned against eviction, reported in usage.

A pool of two workers serving SmolLM2; the store is S3 over HTTP, the index a real Redis.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from store.index import RedisIndex
from store.store import Store
from tests.helpers import POOL_CHUNK, SMOL, Pool, prompt_text, running_pool, wait_settled
from worker.advert import adverts

GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def two_workers(redis_server, s3_server, smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    logs = tmp_path_factory.mktemp("cache-control")
    with running_pool(
        redis_server, s3_server, smollm2, logs, ["smol-1", "smol-2"], KVPOOL_N_CTX="4096", KVPOOL_REQUEST_TIMEOUT_S="1200"
    ) as pool:
        yield pool


def pinned(pool: Pool, beyond_s: float) -> list[float]:
    """Seconds from now until each index entry's pin runs out, for the entries pinned beyond ``beyond_s``."""
    now = time.time()
    index = RedisIndex(redis.Redis.from_url(pool.redis_url))
    return sorted(e.pinned_until - now for e in index.entries() if e.pinned_until - now > beyond_s)


def entries_for(tokens: int) -> int:
    """Index entries that hold a prefix of ``tokens``: its full chunks, and a tail for the rest."""
    return tokens // POOL_CHUNK + (1 if tokens % POOL_CHUNK else 0)


def test_a_marked_prefix_is_kept_even_when_no_answer_comes(two_workers: Pool) -> None:
    client = two_workers.client()
    system = [
        {"type": "text", "text": "Rules of the house. " + prompt_text(7, 300), "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"type": "text", "text": "Answer in one sentence."},
    ]
    question = {"type": "text", "text": "What do the rules say about lanterns?", "cache_control": {"type": "ephemeral"}}
    # max_tokens 0: no answer at all, only the cache filled (Anthropic's pre-warming).
    warm = client.messages.create(model=SMOL, max_tokens=0, system=system, messages=[{"role": "user", "content": [question]}], **GREEDY)
    assert warm.content == [] and warm.stop_reason == "max_tokens" and warm.usage.output_tokens == 0
    u = warm.usage
    long_lived, short_lived = u.cache_creation.ephemeral_1h_input_tokens, u.cache_creation.ephemeral_5m_input_tokens
    assert u.cache_read_input_tokens == 0 and long_lived > 300 and short_lived > 5
    assert u.cache_creation_input_tokens == long_lived + short_lived
    assert u.input_tokens == 0  # the question's mark ends the prompt: every token was written at a breakpoint

    wait_settled(two_workers.redis_url)
    hour = pinned(two_workers, 600)
    assert len(hour) == entries_for(long_lived) and all(3500 < s <= 3600 for s in hour)
    minutes = pinned(two_workers, 60)[: -len(hour)]
    assert len(minutes) >= 1 and all(200 < s <= 300 for s in minutes)

    # Eviction to nothing keeps every pinned entry, and only those.
    client.messages.create(model=SMOL, max_tokens=1, messages=[{"role": "user", "content": prompt_text(8, 100)}], **GREEDY)
    wait_settled(two_workers.redis_url)
    index = RedisIndex(redis.Redis.from_url(two_workers.redis_url))
    assert index.count() > len(hour) + len(minutes)
    with Store.open(two_workers.store) as store:
        store.gc(0)
    assert index.count() == len(pinned(two_workers, 60)) == len(hour) + len(minutes)

    other = {"role": "user", "content": "What do the rules say about windows?"}
    again = client.messages.create(model=SMOL, max_tokens=8, system=system, messages=[other], **GREEDY)
    assert again.usage.cache_read_input_tokens >= long_lived  # the kept system prompt, from a context or the store


@pytest.mark.timeout(1800)  # the first turn evaluates ~3,000 tokens cold, and four workers start
def test_a_long_marked_system_prompt_is_read_from_cache_on_every_later_turn_whichever_worker_answers(two_workers: Pool) -> None:
    """Five turns over a ~3,000-token system prompt; each turn after the first is answered by the worker that did not answer the one before."""
    client = two_workers.client()
    system = [{"type": "text", "text": prompt_text(21, 2980), "cache_control": {"type": "ephemeral"}}]
    assert 2900 < client.messages.count_tokens(model=SMOL, system=system, messages=[{"role": "user", "content": "x"}]).input_tokens < 3200
    history: list[dict] = []
    previous = None
    for turn in range(5):
        history.append({"role": "user", "content": f"Question {turn + 1}: which word comes up most often above?"})
        r = client.messages.create(model=SMOL, max_tokens=16, system=system, messages=history, **GREEDY)
        u = r.usage
        total = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
        worker = r.model_extra["kvpool"]["worker"]
        if turn == 0:
            assert u.cache_creation_input_tokens > 2900  # all but the template's first tokens, which an earlier prompt shared
        else:
            assert worker != previous
            assert u.cache_read_input_tokens >= 0.95 * total, (turn, u, r.model_extra["kvpool"])
            assert r.model_extra["kvpool"]["cached_from_store"] > 0
        history.append({"role": "assistant", "content": r.content[0].text if r.content else "..."})
        wait_settled(two_workers.redis_url)
        if turn < 4:  # the next turn goes to the other worker alone, which never held this one: it restores from the store
            two_workers.workers[worker].stop()
            wait_gone(two_workers, worker)
            for name, w in list(two_workers.workers.items()):
                if w.proc is not None and w.proc.poll() is not None and name != worker:
                    two_workers.start_worker(name)
        previous = worker


def wait_gone(pool: Pool, worker: str, timeout_s: float = 30.0) -> None:
    conn = redis.Redis.from_url(pool.redis_url)
    deadline = time.monotonic() + timeout_s
    while any(a.worker == worker for a in adverts(conn)):
        assert time.monotonic() < deadline, f"{worker} still advertises itself"
        time.sleep(0.05)
