"""Models whose cache cannot be cut into chunks share whole-state checkpoints instead: real redis-server, S3 over HTTP.

A sliding-window cache (``tiny-swa``, cohere2) holds only the window, a recurrent memory
(``tiny-ssm``, mamba) one block per sequence, a hybrid one (``tiny-hybrid``, jamba) both. Their workers store the whole state at each
chunk boundary of a prompt, keyed by the boundary's chain key (`store.checkpoints`), and
any worker resumes from the deepest one on a prompt's chain, answering as a cold run does.
"""

from __future__ import annotations

import math
import time
import urllib.request
from pathlib import Path

import llama_cpp
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gateway.pool.procs import free_port
from store.chain import Namespace
from store.checkpoints import checkpoint_key, checkpoint_name
from store.index import RedisIndex
from tests.helpers import POOL_CHUNK, THREADS, PoolClient, cold_greedy, poll, prompt_text, s3_client
from worker.cache.checkpoints import STOPS_PER_DOUBLING, WINDOW_ALIGN, aligned, checkpoint_stops, spaced
from worker.cache.namespace import namespace_for
from worker.engine.context import flash_attn_for

C = POOL_CHUNK

pytestmark = pytest.mark.fp_path  # answers are compared with a cold run, bit for bit or token for token

KINDS = pytest.mark.parametrize("size", ["tiny-swa", "tiny-ssm", "tiny-hybrid"], ids=["sliding-window", "recurrent", "hybrid"])


def wait_checkpoints(client: PoolClient, tokens: list[int], stops: list[int], timeout_s: float = 20.0) -> tuple[Namespace, list[bytes]]:
    """Publishing runs in the background: wait until a checkpoint is indexed after each of ``stops`` tokens."""
    ns = namespace_for(client.settings, client.fingerprint, checkpoints=True)
    keys = ns.chain(tokens)
    wanted = [checkpoint_key(ns, tokens, keys, e) for e in stops]
    index = RedisIndex(client.conn)
    deadline = time.monotonic() + timeout_s
    while not all(index.present(wanted)):
        assert time.monotonic() < deadline, f"checkpoints after {stops} tokens not all published"
        time.sleep(0.05)
    return ns, keys


def lcp(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture
def cold(uncuttable_models: dict[str, Path], request: pytest.FixtureRequest) -> llama_cpp.Llama:
    size = request.node.callspec.params["size"]
    path = uncuttable_models[size]  # the workers' layout: flash attention as they resolve it for the model
    return llama_cpp.Llama(
        str(path), n_ctx=2048, n_threads=1, n_threads_batch=THREADS, verbose=False, flash_attn=flash_attn_for(path, None)
    )


@KINDS
def test_a_prompt_evaluated_on_one_worker_resumes_on_another_from_its_deepest_checkpoint(
    start_worker, redis_url, uncuttable_models, cold, size: str
) -> None:
    model = uncuttable_models[size]
    port = free_port()
    w1 = start_worker("w1", KVPOOL_MODEL=str(model))
    start_worker("w2", KVPOOL_MODEL=str(model), KVPOOL_METRICS_PORT=str(port))
    start_worker("w3", KVPOOL_MODEL=str(model))
    client = PoolClient(redis.Redis.from_url(redis_url), model)
    prefix = client.tokens(prompt_text(11, 120))
    first_prompt = prefix + client.tokens(" what does the river say")
    second_prompt = prefix + client.tokens(" and where is the harbor lantern")

    first = client.run(first_prompt, worker="w1")
    assert first.usage.cached_tokens == 0
    assert first.tokens == cold_greedy(cold, first_prompt, 24)
    stops = checkpoint_stops(0, len(first_prompt), C, 1, llama_cpp.llama_model_n_swa(cold.model))
    assert len(stops) >= 3
    wait_checkpoints(client, first_prompt, stops)
    cells = namespace_for(client.settings, client.fingerprint).chain(first_prompt)
    assert RedisIndex(client.conn).deepest(cells) == 0, "no cells of an uncuttable cache were published as chunks"
    assert "restore.checkpoints" in w1.log() and "restore.selfcheck" in w1.log()

    resumed = client.run(second_prompt, worker="w2", logprobs=5)
    shared = max(e for e in stops if e <= min(lcp(first_prompt, second_prompt), len(second_prompt) - 2))
    assert resumed.usage.cached_from_store == shared > 0, "restored at the deepest boundary the prompts share"
    assert resumed.usage.cached_from_context == 0
    assert resumed.usage.evaluated_tokens == len(second_prompt) - shared
    assert resumed.tokens == cold_greedy(cold, second_prompt, 24)
    reference = client.run(second_prompt, worker="w3", tenant="elsewhere", logprobs=5)  # another tenant: nothing to restore
    assert reference.usage.cached_tokens == 0
    assert resumed.logprobs == reference.logprobs, "every token's logprob has the cold run's bits"

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels.get("reason")}
    assert samples["kvpool_worker_restore_enabled"] == 1
    assert samples["kvpool_worker_restored_tokens_total"] == shared


@KINDS
def test_a_resent_prompt_resumes_at_its_last_two_tokens_and_a_corrupted_checkpoint_gives_way_to_the_one_before(
    start_worker, redis_url, uncuttable_models, cold, store_settings_s3, size: str
) -> None:
    model = uncuttable_models[size]
    start_worker("w1", KVPOOL_MODEL=str(model))
    w2 = start_worker("w2", KVPOOL_MODEL=str(model))
    w3 = start_worker("w3", KVPOOL_MODEL=str(model))
    client = PoolClient(redis.Redis.from_url(redis_url), model)
    prompt = client.tokens(prompt_text(12, 140))
    client.run(prompt, worker="w1")
    stops = checkpoint_stops(0, len(prompt), C, 1, llama_cpp.llama_model_n_swa(cold.model))
    ns, keys = wait_checkpoints(client, prompt, stops)

    resent = client.run(prompt, worker="w2", logprobs=5)
    assert resent.usage.cached_from_store == stops[-1] >= len(prompt) - 2 - WINDOW_ALIGN, "resumed where the first worker stopped"
    assert resent.tokens == cold_greedy(cold, prompt, 24)

    name = str(checkpoint_name(ns, prompt, keys, stops[-1]))
    bucket, _, prefix = store_settings_s3.store_url.removeprefix("s3://").partition("/")
    s3 = s3_client(store_settings_s3)
    blob = bytearray(s3.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read())
    blob[-100] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=bytes(blob))

    r = client.run(prompt, worker="w3", logprobs=5)
    assert r.usage.cached_from_store == stops[-2], "the checkpoint before the bad one was restored"
    assert r.tokens == resent.tokens and r.logprobs == resent.logprobs
    assert "checkpoint.rejected" in w3.log() and "checkpoint.rejected" not in w2.log()
    s3.head_object(Bucket=bucket, Key=f"{prefix}/quarantine/{name}")


def test_a_sliding_window_worker_never_cuts_back_past_the_window_a_restore_left(start_worker, redis_url, uncuttable_models) -> None:
    """After a restore the context holds only the window's cells: a later prompt sharing less than that is not served from it."""
    model = uncuttable_models["tiny-swa"]
    start_worker("w1", KVPOOL_MODEL=str(model))
    start_worker("w2", KVPOOL_MODEL=str(model))
    client = PoolClient(redis.Redis.from_url(redis_url), model)
    cold = llama_cpp.Llama(
        str(model), n_ctx=2048, n_threads=1, n_threads_batch=THREADS, verbose=False, flash_attn=flash_attn_for(model, None)
    )
    long_prompt = client.tokens(prompt_text(13, 200))
    client.run(long_prompt, worker="w1")
    wait_checkpoints(client, long_prompt, checkpoint_stops(0, len(long_prompt), C, 1, 32))
    restored = client.run(long_prompt, worker="w2")
    assert restored.usage.cached_from_store > 3 * C

    short = long_prompt[: 2 * C] + client.tokens(" a different ending altogether")
    again = client.run(short, worker="w2")
    assert again.usage.cached_from_context == 0, "the window before position 64 was not restored, so it is not reused"
    assert again.usage.cached_from_store == 2 * C, "the checkpoint at the boundary both prompts share serves instead"
    assert again.tokens == cold_greedy(cold, short, 24)


def test_gemma3_resumes_past_its_window_on_another_worker_with_the_cold_bits(start_worker, redis_url, gemma3) -> None:
    """The real sliding-window model: a checkpoint past the 512-token window holds only the window, and still gives cold's bits."""
    every = 256 // C  # a checkpoint every 256 tokens: each holds the whole window (about 9 MB)
    w1 = start_worker("w1", KVPOOL_MODEL=str(gemma3), KVPOOL_CHECKPOINT_EVERY=str(every))
    start_worker("w2", KVPOOL_MODEL=str(gemma3), KVPOOL_CHECKPOINT_EVERY=str(every))
    client = PoolClient(redis.Redis.from_url(redis_url), gemma3)
    prompt = client.tokens("<start_of_turn>user\n" + prompt_text(14, 800) + "\nSum it up.<end_of_turn>\n<start_of_turn>model\n")
    assert len(prompt) > 3 * 256 + 2
    first = client.run(prompt, worker="w1", logprobs=5)
    assert first.usage.cached_tokens == 0
    stops = checkpoint_stops(0, len(prompt), C, every, 512)
    wait_checkpoints(client, prompt, stops)
    assert "restore.checkpoints" in w1.log()

    resumed = client.run(prompt, worker="w2", logprobs=5)
    assert resumed.usage.cached_from_store == stops[-1] > len(prompt) - 2 - WINDOW_ALIGN, "restored past the window, near the prompt's end"
    assert resumed.tokens == first.tokens
    assert resumed.logprobs == first.logprobs, "every token's logprob has the cold run's bits"


def test_checkpoints_are_saved_at_boundaries_where_the_last_message_starts_and_before_the_last_two_tokens() -> None:
    assert checkpoint_stops(0, 100, 32, 1) == [32, 64, 96, 98]
    assert checkpoint_stops(0, 100, 32, 1, hints=[70]) == [32, 64, 70, 96, 98]
    assert checkpoint_stops(40, 100, 32, 2, hints=[65]) == [64, 98], "a stop is never one token from another (65)"
    assert checkpoint_stops(0, 66, 32, 1) == [32, 64], "the end is a boundary"
    window = checkpoint_stops(0, 700, 256, 1, n_swa=512, hints=[600])
    assert window == [256, 512, 576, 672], "a window model stops where its window starts at a multiple of 32"
    assert all(aligned(s, 512) for s in window)


def test_boundary_checkpoints_are_dense_near_the_start_and_geometric_further_out() -> None:
    assert [d for d in range(1, 70) if spaced(d, 1)] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    assert [d for d in range(1, 40) if spaced(d, 2)] == [2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32], "in units of `every` chunks"
    assert len(checkpoint_stops(0, 32 * 1024, 256, 1)) == 24, "a 32k prompt: 23 boundaries and its end (every boundary: 128)"


@settings(max_examples=300, deadline=None, database=None)
@given(
    start=st.integers(0, 70_000),
    length=st.integers(3, 70_000),
    chunk=st.sampled_from([16, 32, 64, 256, 512]),
    every=st.integers(1, 4),
    n_swa=st.sampled_from([0, 512, 4096]),
    hints=st.lists(st.integers(1, 140_000), max_size=3),
)
def test_checkpoint_stops_are_few_in_the_prompt_and_always_reach_its_end(
    start: int, length: int, chunk: int, every: int, n_swa: int, hints: list[int]
) -> None:
    n = start + length
    stops = checkpoint_stops(start, n, chunk, every, n_swa, hints)
    assert stops == sorted(set(stops)) and all(start < s <= n - 2 for s in stops), "sorted, within what is evaluated"
    boundaries = [d * chunk for d in range(start // chunk + 1, (n - 2) // chunk + 1) if spaced(d, every) and aligned(d * chunk, n_swa)]
    assert set(boundaries) <= set(stops), "the same boundaries whatever the prompt: every worker picks them, lookups find them"
    chunks = max(2, (n - 2) // (chunk * every))
    assert len(boundaries) <= STOPS_PER_DOUBLING * (math.log2(chunks) + 2), "logarithmic in the prompt's length"
    assert len(stops) <= len(boundaries) + len(hints) + 1
    if not n_swa or chunk > WINDOW_ALIGN:
        assert all(s % chunk or spaced(s // chunk, every) for s in stops), "an end on a boundary stays a tail, which is superseded"
    end = n - 2 if not n_swa or n - 2 <= n_swa else n - 2 - (n - 2 - n_swa) % WINDOW_ALIGN  # the end, aligned for a window
    off = WINDOW_ALIGN + 1 if n_swa else 2  # moved off a boundary not spaced, then kept two tokens from another stop
    if end - start > off:
        assert stops and stops[-1] >= end - off, "the newest checkpoint, the next turn's resume point, is always saved"


def test_each_turn_of_a_chat_supersedes_the_tail_checkpoints_before_the_one_it_resumed_from(
    start_worker, redis_url, uncuttable_models
) -> None:
    """Three turns, each resending the last prompt and more, on alternate workers: each resumes from the last turn's end;
    the third, once its own checkpoints are stored, drops the first turn's end (the second's, which it resumed from, stays)."""
    model = uncuttable_models["tiny-ssm"]
    start_worker("w1", KVPOOL_MODEL=str(model))
    start_worker("w2", KVPOOL_MODEL=str(model))
    client = PoolClient(redis.Redis.from_url(redis_url), model)
    chat = client.tokens(prompt_text(31, 200))
    turns = [chat[:n] for n in (110, 170, 230)]  # their ends (108, 168, 228) fall between boundaries: tail checkpoints
    ends = []
    for i, prompt in enumerate(turns):
        r = client.run(prompt, worker="w1" if i % 2 == 0 else "w2")
        ends.append(checkpoint_stops(0, len(prompt), C, 1)[-1])
        assert ends[-1] % C, "each turn's end is a tail checkpoint"
        assert r.usage.cached_from_store == (ends[-2] if i else 0), "each turn resumes from the last one's end"
        ns, keys = wait_checkpoints(client, prompt, [ends[-1]])
    index = RedisIndex(client.conn)
    first, second = (checkpoint_key(ns, turns[2], keys, e) for e in ends[:2])
    poll(lambda: not index.present([first])[0], "the first turn's end superseded")
    assert index.present([second]) == [True], "the checkpoint the last turn resumed from stays"
