"""Sequences of one worker share a prefix through the context: a sibling's cells are copied, not restored or evaluated.

In-process, on the real model (SmolLM2-135M-Instruct): one engine opens a context of two
sequences with a store (S3 over HTTP, a Redis of the module's own), as a worker with
``KVPOOL_PARALLEL=2`` does. Sequence 0 answers a prompt, and the store holds it; then
sequence 1, which holds nothing, is asked the prompt plus a question, while sequence 0
still generates. It copies the prefix from sequence 0's cells (`worker.cache.siblings`): none
of it comes from the store and none is evaluated again, and its answer is a cold
evaluation's, bit for bit, whether the copy is llama.cpp's stream copy (the build
``deploy/setup.sh`` makes has what applies it at once) or goes through host memory (a
build without it). Another tenant's cells are never copied.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from gateway.pool.procs import RedisServer
from gateway.pool.s3server import S3Server
from store.store import Store
from tests.helpers import THREADS, cold_answer, poll, prompt_text, s3_settings
from worker import metrics
from worker.answering import Engine
from worker.cache import siblings
from worker.engine.context import open_llama
from worker.engine.kvstate import describe_state
from worker.engine.llama_state import last_logits, read_ctx_state, write_ctx_state
from worker.engine.sequence import SeqView, restream, single_stream
from worker.protocol import JobResult, SamplingParams, TokenEvent, job_spec
from worker.settings import WorkerSettings

CHUNK = 64

pytestmark = pytest.mark.fp_path


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, smollm2: Path) -> Iterator[list[Engine]]:
    with RedisServer(tmp_path_factory.mktemp("redis-siblings")) as server:
        base = s3_settings(s3_server.endpoint_url, f"kvpool-siblings-{uuid.uuid4().hex[:8]}", server.url)
        settings = WorkerSettings(**{**base.model_dump(), "chunk_size": CHUNK, "n_ctx": 2048, "n_threads": THREADS, "parallel": 2})
        engine = Engine.open(settings, smollm2, store=Store.open(settings), name="s.0")
        yield [engine, engine.for_sequence(1, "s.1")]
        engine.close()


@pytest.fixture(scope="module")
def cold(smollm2: Path) -> llama_cpp.Llama:
    return open_llama(smollm2, flash_attn=True, n_ctx=2048, n_threads=THREADS, n_threads_batch=THREADS)


def ask(
    engine: Engine, tokens: list[int], *, n: int = 8, tenant: str = "", started: threading.Event | None = None
) -> tuple[np.ndarray, JobResult]:
    seen: list[np.ndarray] = []

    def emit(_: TokenEvent) -> bool:
        if not seen:
            seen.append(last_logits(engine.llm))
            if started is not None:
                started.set()
        return True

    spec = job_spec(
        tokens,
        model=engine.fingerprint,
        chunk_size=CHUNK,
        tenant_salt=tenant,
        sampling=SamplingParams(max_tokens=n, temperature=0.0, top_k=1),
    )
    result = engine.run(spec, emit)
    engine.after_answer()
    return seen[0], result


def copied(engine: Engine) -> float:
    return metrics.SIBLING_TOKENS.labels(**engine.labels)._value.get()


@pytest.mark.parametrize("how", ["stream", "state"])
def test_a_prefix_a_busy_sibling_holds_is_copied_from_its_cells_with_the_cold_bits_and_no_store_read(
    engines: list[Engine], cold: llama_cpp.Llama, how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = engines
    if how == "state":
        monkeypatch.setattr(siblings, "APPLY_UPDATES", None)
    else:
        assert siblings.APPLY_UPDATES is not None, "this llama.cpp build cannot apply a stream copy at once"
    seed = 71 if how == "stream" else 73
    ask(second, cold.tokenize(prompt_text(seed + 1, 900).encode())[:820])  # its stream holds other cells where the prefix goes
    shared = cold.tokenize(prompt_text(seed, 900).encode())[:800]
    ask(first, shared)  # sequence 0 holds it, and the store too
    assert first.publisher is not None and first.publisher.wait_idle()
    second.forget_context()
    before = copied(second)
    caplog.set_level(logging.INFO, logger="kvpool.worker")

    started = threading.Event()
    busy: list[object] = []
    t = threading.Thread(
        target=lambda: busy.append(ask(first, [*shared, *cold.tokenize(b" Go on.", add_bos=False)], n=120, started=started))
    )
    t.start()  # sequence 0 keeps generating while sequence 1 takes its prefix
    assert started.wait(120)
    prompt = [*shared, *cold.tokenize(b" And then?", add_bos=False)]
    logits, result = ask(second, prompt)
    t.join(timeout=300)

    assert result.usage.cached_from_context == len(shared), "the prefix did not come from the sibling's cells"
    assert result.usage.cached_from_store == 0 and result.usage.evaluated_tokens == len(prompt) - len(shared)
    assert copied(second) - before == len(shared)
    assert [r.how for r in caplog.records if r.getMessage() == "prefix.sibling_copy"] == [how]  # type: ignore[attr-defined]
    ref_logits, ref_tokens = cold_answer(cold, prompt)
    assert np.array_equal(logits, ref_logits) and result.tokens == ref_tokens
    busy_logits, busy_result = busy[0]  # type: ignore[misc]
    ref_logits, ref_tokens = cold_answer(cold, [*shared, *cold.tokenize(b" Go on.", add_bos=False)], 120)
    assert np.array_equal(busy_logits, ref_logits) and busy_result.tokens == ref_tokens, "the sibling copied from answered otherwise"


def test_another_tenants_cells_are_never_copied(engines: list[Engine], cold: llama_cpp.Llama) -> None:
    first, second = engines
    prompt = cold.tokenize(prompt_text(72, 400).encode())
    ask(first, prompt, tenant="tenant-a")
    second.forget_context()
    before = copied(second)
    logits, result = ask(second, prompt, tenant="tenant-b")
    assert result.usage.cached_from_context == 0 and copied(second) == before
    ref_logits, ref_tokens = cold_answer(cold, prompt)
    assert np.array_equal(logits, ref_logits) and result.tokens == ref_tokens


def test_a_stream_copy_is_applied_at_once_and_holds_the_bytes_a_copy_through_host_memory_does(
    engines: list[Engine], cold: llama_cpp.Llama
) -> None:
    """Read back in the same task, before any decode: llama.cpp alone would copy the bytes only at the next one."""
    first, second = engines
    ask(first, cold.tokenize(prompt_text(75, 400).encode()))
    ask(second, cold.tokenize(prompt_text(76, 500).encode()))  # the cells the copy replaces
    n = 256
    view = second.llm
    assert isinstance(view, SeqView)

    def both(llm: llama_cpp.Llama) -> tuple[bytes, bytes]:
        mem = llama_cpp.llama_get_memory(llm.ctx)
        assert siblings.copy_stream(llm, 0, 1)
        llama_cpp.llama_memory_seq_rm(mem, 1, n, -1)
        by_stream = bytes(single_stream(read_ctx_state(llm.ctx, 1), 1, 2))
        llama_cpp.llama_memory_seq_rm(mem, 1, -1, -1)
        write_ctx_state(llm.ctx, restream(read_ctx_state(llm.ctx, 0), 0, 1, 2), 1)
        llama_cpp.llama_memory_seq_rm(mem, 1, n, -1)
        return by_stream, bytes(single_stream(read_ctx_state(llm.ctx, 1), 1, 2))

    by_stream, by_state = view.loop.run(1, both)
    second.forget_context()
    view.reset()
    assert describe_state(by_stream).n_cells == n and by_stream == by_state


def test_a_sibling_whose_cells_are_gone_is_never_copied_from_whatever_its_records_say(engines: list[Engine], cold: llama_cpp.Llama) -> None:
    """Its records lag its cells (a restore had removed them in a task, its job thread not yet caught up): the copy checks the cells."""
    first, second = engines
    tokens = cold.tokenize(prompt_text(91, 400).encode())[:300]
    ask(first, tokens)
    view = first.llm
    assert isinstance(view, SeqView)
    try:
        view.loop.run(view.seq, lambda llm: llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), view.seq, -1, -1))
        question = [*tokens, *cold.tokenize(b" And then?", add_bos=False)]
        before = copied(second)
        logits, result = ask(second, question)
    finally:
        first.forget_context()
    assert copied(second) == before, "nothing was copied from an empty stream"
    ref_logits, ref_tokens = cold_answer(cold, question)
    assert np.array_equal(logits, ref_logits) and result.tokens == ref_tokens


def test_a_clear_changes_the_sequences_records_in_the_same_task_as_its_cells(engines: list[Engine], cold: llama_cpp.Llama) -> None:
    """A restore's clear and a sibling's look at the cleared sequence, in one batch of the loop's tasks: the look sees nothing held."""
    first, _ = engines
    tokens = cold.tokenize(prompt_text(92, 200).encode())
    ask(first, tokens)
    view = first.llm
    assert isinstance(view, SeqView)
    want = np.asarray(tokens, dtype=np.intc)
    assert view.loop.run(1, lambda llm: siblings.held_for(first.held, "", want)) > 100
    running, gate, seen = threading.Event(), threading.Event(), []

    def hold_the_loop(llm: llama_cpp.Llama) -> None:
        running.set()
        gate.wait(30)

    threads = [threading.Thread(target=view.loop.run, args=(1, hold_the_loop))]
    threads[0].start()
    running.wait(30)
    threads.append(threading.Thread(target=view.clear))
    threads.append(threading.Thread(target=lambda: seen.append(view.loop.run(1, lambda llm: siblings.held_for(first.held, "", want)))))
    for i, t in enumerate(threads[1:], start=1):
        t.start()
        poll(lambda i=i: view.loop.pending() == i, "the task queued behind the held loop")
    gate.set()
    for t in threads:
        t.join(30)
    first.forget_context()
    assert seen == [0], "the look ran right after the clear, and found nothing held"
