"""One worker, many sequences (KVPOOL_PARALLEL): answers never depend on what else ran in the same batches.

In-process, on the real model (SmolLM2-135M-Instruct, f16 KV): one engine opens a
context of four sequences and the other three sequences' engines share it
(`Engine.for_sequence`); jobs run in threads, as a worker process runs them, and the
batcher decodes them together. Every answer is compared with a cold evaluation on a
context of its own: the same first-token logits, bit for bit, and the same greedy
tokens; and a sequence's cells, read back from the shared context, are the bytes a
cold evaluation of prompt plus answer holds.

Then in processes, on the generated model: a worker SIGKILLed with four jobs in
flight loses none and answers none twice; and its four sequences are four routable
RQ workers.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from gateway.pool.procs import RedisServer
from gateway.pool.s3server import S3Server
from store.store import Store
from tests.helpers import THREADS, PoolClient, cold_answer, cold_generate, cold_greedy, prompt_text, s3_settings
from worker.answering import Engine
from worker.cache.kvchunks import cut_cells
from worker.client import events
from worker.engine.context import open_llama
from worker.engine.decoding import DecodeMode
from worker.engine.llama_state import evaluate_prompt, last_logits, read_seq_state
from worker.protocol import DoneEvent, SamplingParams, StartEvent, TokenEvent, job_spec
from worker.settings import WorkerSettings

CHUNK = 64
P = 4
N = 12

pytestmark = pytest.mark.fp_path


@dataclass
class Answer:
    logits: np.ndarray
    tokens: list[int]
    finish: str
    cached_store: int
    held: int
    cached_context: int = 0


def ask(engine: Engine, tokens: list[int], *, n: int = N, cancel_after: int | None = None, **sampling: object) -> Answer:
    """One job on ``engine``, as the worker runs it; the logits its first token was sampled from."""
    seen: list[np.ndarray] = []
    sent = [0]

    def emit(_: TokenEvent) -> bool:
        if not seen:
            seen.append(last_logits(engine.llm))
        sent[0] += 1
        return cancel_after is None or sent[0] < cancel_after

    spec = job_spec(
        tokens,
        model=engine.fingerprint,
        chunk_size=CHUNK,
        sampling=SamplingParams(**{"max_tokens": n, "temperature": 0.0, "top_k": 1, **sampling}),
    )
    result = engine.run(spec, emit)
    engine.after_answer()
    u = result.usage
    return Answer(seen[0], result.tokens, result.finish_reason, u.cached_from_store, engine.llm.n_tokens, u.cached_from_context)


def together(calls: list[Callable[[], Answer]]) -> list[Answer]:
    """Run the calls at once, one thread each (one per sequence), as a worker's RQ workers do."""
    out: list[Answer | BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as e:  # surfaced below
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return [o for o in out if isinstance(o, Answer)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, smollm2: Path) -> Iterator[list[Engine]]:
    """Four sequences of one context, with a store (S3 over HTTP, a Redis of the module's own)."""
    with RedisServer(tmp_path_factory.mktemp("redis-batched")) as server:
        base = s3_settings(s3_server.endpoint_url, f"kvpool-batched-{uuid.uuid4().hex[:8]}", server.url)
        settings = WorkerSettings(**{**base.model_dump(), "chunk_size": CHUNK, "n_ctx": 1024, "n_threads": THREADS, "parallel": P})
        engine = Engine.open(settings, smollm2, store=Store.open(settings), name="b.0")
        yield [engine, *(engine.for_sequence(i, f"b.{i}") for i in range(1, P))]
        engine.close()


@pytest.fixture(scope="module")
def cold(smollm2: Path) -> llama_cpp.Llama:
    """A context of its own: the reference every batched answer is compared with."""
    return open_llama(smollm2, flash_attn=True, n_ctx=1024, n_threads=THREADS, n_threads_batch=THREADS)


def prompts(seed: int, count: int, cold: llama_cpp.Llama) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [cold.tokenize(prompt_text(seed * 100 + i, int(rng.integers(20, 200))).encode()) for i in range(count)]


def test_the_context_decodes_exactly_in_pairs(engines: list[Engine]) -> None:
    assert engines[0].decode is DecodeMode.PAIR or engines[0].decode is DecodeMode.SINGLE
    assert engines[0].restore_enabled and engines[0].exact


def test_answers_are_the_same_bits_at_concurrency_one_and_four(engines: list[Engine], cold: llama_cpp.Llama) -> None:
    texts = prompts(1, 8, cold)
    alone = [ask(engines[0], t) for t in texts]
    four = together([lambda t=t, e=e: ask(e, t) for t, e in zip(texts[:4], engines, strict=True)])
    four += together([lambda t=t, e=e: ask(e, t) for t, e in zip(texts[4:], engines, strict=True)])
    for t, a, b in zip(texts, alone, four, strict=True):
        ref_logits, ref_tokens = cold_answer(cold, t, N)
        assert np.array_equal(a.logits, ref_logits) and np.array_equal(b.logits, ref_logits)
        assert a.tokens == b.tokens == ref_tokens


def test_an_answers_cells_in_a_shared_context_are_a_cold_evaluations(engines: list[Engine], cold: llama_cpp.Llama) -> None:
    texts = prompts(2, P, cold)
    answers = together([lambda t=t, e=e: ask(e, t) for t, e in zip(texts, engines, strict=True)])
    for t, a, e in zip(texts, answers, engines, strict=True):
        held = t + a.tokens[:-1]
        assert a.held == len(held)  # every token but the answer's last, which was only sampled: the next turn evaluates it
        cold.reset()
        evaluate_prompt(cold, held, 0)
        assert cut_cells(read_seq_state(e.llm), 0, len(held)) == cut_cells(read_seq_state(cold), 0, len(held))


def test_seeded_sampling_in_a_shared_context_draws_what_a_cold_run_draws(engines: list[Engine], cold: llama_cpp.Llama) -> None:
    texts = prompts(5, P, cold)
    sampling = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1}
    answers = together(
        [lambda t=t, e=e, i=i: ask(e, t, n=20, seed=100 + i, **sampling) for i, (t, e) in enumerate(zip(texts, engines, strict=True))]
    )
    for i, (t, a) in enumerate(zip(texts, answers, strict=True)):
        cold.set_seed(100 + i)
        want = cold_generate(cold, t, 20, temp=0.9, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1)
        assert a.tokens == want, f"sequence {i} drew other tokens than a cold run with the same seed"


def test_a_cancelled_sequence_leaves_the_others_bits_unchanged(engines: list[Engine], cold: llama_cpp.Llama) -> None:
    texts = prompts(3, P, cold)
    calls = [
        lambda t=t, e=e, i=i: ask(e, t, n=24, cancel_after=3 if i == 1 else None)
        for i, (t, e) in enumerate(zip(texts, engines, strict=True))
    ]
    answers = together(calls)
    assert answers[1].finish == "cancelled" and len(answers[1].tokens) == 3
    for i in (0, 2, 3):
        ref_logits, ref_tokens = cold_answer(cold, texts[i], 24)
        assert np.array_equal(answers[i].logits, ref_logits) and answers[i].tokens == ref_tokens


def test_steps_of_sequences_apart_share_one_pass_with_a_filler_and_keep_every_sequences_bits(
    engines: list[Engine], cold: llama_cpp.Llama
) -> None:
    loop = engines[0].llm.loop
    idle = cold.tokenize(prompt_text(47, 120).encode())
    first = ask(engines[1], idle)  # sequence 1 holds a prompt and its answer, and stays idle while 0 and 2 decode
    before, loop.step_cost, filled = loop.step_cost, [1.0, 1.01, 1.02, 1.03], loop.filled  # a filler always pays
    try:
        texts = prompts(6, 2, cold)
        answers = together([lambda: ask(engines[0], texts[0], n=30), lambda: ask(engines[2], texts[1], n=30)])
    finally:
        loop.step_cost = before
    assert loop.filled > filled
    for t, a in zip(texts, answers, strict=True):
        ref_logits, ref_tokens = cold_answer(cold, t, 30)
        assert np.array_equal(a.logits, ref_logits) and a.tokens == ref_tokens
    follow = [*idle, *first.tokens, *cold.tokenize(b" Say more.", add_bos=False)]
    again = ask(engines[1], follow)  # the fillers' cells are gone: sequence 1 resumes from all it held, to the bit
    assert again.cached_context >= first.held
    ref_logits, ref_tokens = cold_answer(cold, follow, N)
    assert np.array_equal(again.logits, ref_logits) and again.tokens == ref_tokens


def test_a_restore_into_one_sequence_while_three_decode(engines: list[Engine], cold: llama_cpp.Llama) -> None:
    shared = cold.tokenize(prompt_text(41, 400).encode())
    ask(engines[0], shared)  # publishes the prompt's chunks and tail
    assert engines[0].publisher is not None and engines[0].publisher.wait_idle()
    for e in (engines[0], engines[3]):  # no sequence holds it: sequence 3 restores it from the store, not from a sibling
        e.forget_context()
    texts = prompts(4, 3, cold)
    calls = [lambda t=t, e=e: ask(e, t, n=40) for t, e in zip(texts, engines[:3], strict=True)]
    calls.append(lambda: ask(engines[3], [*shared, *cold.tokenize(b" And then?", add_bos=False)]))
    answers = together(calls)
    restored = answers[3]
    assert restored.cached_store >= len(shared) // CHUNK * CHUNK
    ref_logits, ref_tokens = cold_answer(cold, [*shared, *cold.tokenize(b" And then?", add_bos=False)], N)
    assert np.array_equal(restored.logits, ref_logits) and restored.tokens == ref_tokens
    for t, a in zip(texts, answers[:3], strict=True):
        ref_logits, ref_tokens = cold_answer(cold, t, 40)
        assert np.array_equal(a.logits, ref_logits) and a.tokens == ref_tokens


def test_two_sequences_sent_the_same_prompt_at_once_evaluate_it_once(engines: list[Engine], cold: llama_cpp.Llama) -> None:
    """Each sequence leases under its own name: one evaluates the prompt's chunks, the other waits for them and copies
    them from its sibling's cells (`worker.cache.siblings`).

    It waits even when its own evaluation rate says evaluating here would be quicker (as
    it would be on another worker's cores): a sibling shares the batcher and the cores.
    """
    rate = engines[0].eval_rate.tokens_per_s
    for e in engines[:2]:
        assert e.leases is not None and e.leases.min_wait_s == 0.0
        e.forget_context()
    engines[0].eval_rate.tokens_per_s = 1e9  # shared by the sequences: evaluating here "takes no time"
    restores = [replace(e.finder.restore_rate) for e in engines[:2]]
    for e in engines[:2]:  # and restoring less than none, so that the one that waited restores (worker.cache.restore_choice)
        e.finder.restore_rate.bytes_per_token, e.finder.restore_rate.bytes_per_s = 1.0, 1e12
    try:
        prompt = cold.tokenize(prompt_text(43, 300).encode())
        a, b = together([lambda e=e: ask(e, prompt) for e in engines[:2]])
    finally:
        engines[0].eval_rate.tokens_per_s = rate
        for e, r in zip(engines[:2], restores, strict=True):
            e.finder.restore_rate = r
    assert {engines[0].leases.owner, engines[1].leases.owner} == {"b.0", "b.1"}
    full = len(prompt) // CHUNK * CHUNK
    assert sorted([a.cached_context, b.cached_context])[1] >= full, "both sequences evaluated the prompt"
    assert a.cached_store == b.cached_store == 0, "the one that waited went to the store for what its sibling holds"
    ref_logits, ref_tokens = cold_answer(cold, prompt, N)
    for x in (a, b):
        assert np.array_equal(x.logits, ref_logits) and x.tokens == ref_tokens


NO_EOS = {"logit_bias": {2: -100.0}, "max_tokens": 2000}


def test_a_worker_killed_with_four_jobs_in_flight_loses_none_and_answers_none_twice(start_worker, client: PoolClient) -> None:
    w1 = start_worker("w1", KVPOOL_N_CTX="2048", KVPOOL_PARALLEL="4")
    prompts = [client.tokens(prompt_text(60 + i, 30)) for i in range(4)]
    jobs = [client.submit(client.spec(p, **NO_EOS)) for p in prompts]
    running: set[str] = set()
    for job_id in jobs:  # every job started on one of w1's sequences and streams tokens
        for ev in events(client.conn, job_id, timeout_s=60):
            if isinstance(ev, StartEvent):
                running.add(ev.worker)
            if isinstance(ev, TokenEvent):
                break
    assert running == {"w1.0", "w1.1", "w1.2", "w1.3"}
    w1.kill()
    start_worker("w2", KVPOOL_N_CTX="2048")
    for job_id in jobs:
        seen = list(events(client.conn, job_id, timeout_s=300))
        done = [e for e in seen if isinstance(e, DoneEvent)]
        starts = [e for e in seen if isinstance(e, StartEvent)]
        assert len(done) == 1, f"job {job_id} answered {len(done)} times"
        assert [s.worker for s in starts][-1] == "w2" and starts[-1].attempt == 2
        usage = done[0].result.usage
        assert done[0].result.finish_reason == "length" and usage.completion_tokens == min(NO_EOS["max_tokens"], 2048 - usage.prompt_tokens)


def test_each_sequence_is_a_routable_worker(start_worker, client: PoolClient, cold_llm) -> None:
    start_worker("w1", KVPOOL_PARALLEL="3")
    for name in ("w1.0", "w1.1", "w1.2"):
        tokens = client.tokens(prompt_text(70, 20) + name)
        r = client.run(tokens, worker=name)
        assert r.worker == name and r.tokens == cold_greedy(cold_llm, tokens, 24)


def test_closing_the_engines_of_a_shared_context_frees_it(tiny_model: Path) -> None:
    settings = WorkerSettings(chunk_size=CHUNK, n_ctx=256, n_threads=1, parallel=2)
    engine = Engine.open(settings, tiny_model, store=None, name="c.0")
    other = engine.for_sequence(1, "c.1")
    shared = engine.loaded.context.llm
    other.close()
    engine.close()
    assert shared._ctx.ctx is None, "the llama.cpp context of the sequences is freed"
