"""A job that stops mid-prompt stops between two steps of the engine loop, and leaves nothing behind.

In-process, on the real model (SmolLM2-135M-Instruct): one engine opens a context of two
sequences, as a worker with ``KVPOOL_PARALLEL=2`` does. A job on sequence 0 is stopped
while its long prompt is being evaluated, in the ways a worker sees it:

* its client leaves or cancels: the job's watch (`worker.process.jobstream.JobStream.watch`, which
  reads the cancel key) says so between prompt pieces;
* RQ's job timeout raises in the job's thread: in a sequence's own thread (RQ's
  ``TimerDeathPenalty``) and in the main thread (SIGALRM, ``UnixSignalDeathPenalty``).

Each time the loop drops the job's request before its next piece, nothing is left
waiting in the loop, the other sequence's answer is a cold evaluation's bit for bit,
and the stopped sequence's next job (a retry of the same prompt) answers as cold.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from rq.timeouts import JobTimeoutException, TimerDeathPenalty, UnixSignalDeathPenalty

from tests.helpers import THREADS, cold_answer, prompt_text
from worker.answering import Engine
from worker.engine.context import open_llama
from worker.engine.llama_state import last_logits
from worker.engine.rounds import CallKind
from worker.errors import JobAborted
from worker.protocol import JobResult, SamplingParams, TokenEvent, job_spec
from worker.settings import WorkerSettings

CHUNK = 64
N_CTX = 3200

pytestmark = pytest.mark.fp_path


@pytest.fixture(scope="module")
def engines(smollm2: Path) -> Iterator[list[Engine]]:
    settings = WorkerSettings(chunk_size=CHUNK, n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS, parallel=2)
    engine = Engine.open(settings, smollm2, store=None, name="a.0")
    yield [engine, engine.for_sequence(1, "a.1")]
    engine.close()


@pytest.fixture(scope="module")
def cold(smollm2: Path) -> llama_cpp.Llama:
    return open_llama(smollm2, flash_attn=True, n_ctx=N_CTX, n_threads=THREADS, n_threads_batch=THREADS)


def prompt(cold: llama_cpp.Llama, seed: int, tokens: int) -> list[int]:
    out = cold.tokenize(prompt_text(seed, tokens).encode())[:tokens]
    assert len(out) == tokens
    return out


def run(engine: Engine, tokens: list[int], n: int = 8) -> tuple[np.ndarray, JobResult]:
    """One job; the logits its first token was sampled from."""
    seen: list[np.ndarray] = []

    def emit(_: TokenEvent) -> bool:
        if not seen:
            seen.append(last_logits(engine.llm))
        return True

    spec = job_spec(tokens, model=engine.fingerprint, chunk_size=CHUNK, sampling=SamplingParams(max_tokens=n, temperature=0.0, top_k=1))
    result = engine.run(spec, emit)
    return seen[0], result


def prompt_tokens_decoded(engine: Engine) -> int:
    totals = engine.loaded.context.loop.totals
    return sum(totals[k].tokens for k in (CallKind.PROMPT, CallKind.MIXED) if k in totals)


def wait_for(what: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[BaseException | object]]:
    out: list[BaseException | object] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # what the job's thread saw, looked at by the test
            out.append(e)

    t = threading.Thread(target=body)
    t.start()
    return t, out


def assert_retry_is_cold(engine: Engine, cold: llama_cpp.Llama, tokens: list[int]) -> None:
    engine.forget_context()  # what `worker.process.jobs` does after a failed attempt
    logits, result = run(engine, tokens)
    ref_logits, ref_tokens = cold_answer(cold, tokens)
    assert np.array_equal(logits, ref_logits) and result.tokens == ref_tokens, (result.finish_reason, result.tokens, ref_tokens)


def test_a_client_that_leaves_during_a_3000_token_prompt_frees_the_sequence_within_one_piece(
    engines: list[Engine], cold: llama_cpp.Llama
) -> None:
    engine, other = engines
    loop = engine.loaded.context.loop
    long = prompt(cold, 1, 3000)
    gone = threading.Event()
    dropped = loop.dropped

    def job() -> object:
        with engine.llm.watching(lambda: "the client left" if gone.is_set() else None):
            return run(engine, long)

    t, out = in_thread(job)
    start = prompt_tokens_decoded(engine)
    wait_for(lambda: prompt_tokens_decoded(engine) > start)  # a first piece is in: the next one has just begun
    at_leave = prompt_tokens_decoded(engine)
    gone.set()
    t.join(timeout=60)
    assert isinstance(out[0], JobAborted), out
    wait_for(lambda: loop.pending() == 0 and loop.dropped == dropped + 1)
    piece = loop.n_ubatch
    assert prompt_tokens_decoded(engine) - at_leave <= piece, "the loop went on with the prompt after the client left"
    assert prompt_tokens_decoded(engine) - start < len(long) - piece

    short = prompt(cold, 2, 120)
    assert_retry_is_cold(engine, cold, short)
    assert_retry_is_cold(other, cold, prompt(cold, 3, 90))


def test_a_job_timed_out_mid_prompt_in_its_own_thread_leaves_nothing_in_the_loop_and_its_retry_answers_as_cold(
    engines: list[Engine], cold: llama_cpp.Llama
) -> None:
    engine, other = engines
    loop = engine.loaded.context.loop
    long = prompt(cold, 4, 1000)
    neighbour = prompt(cold, 5, 200)
    dropped = loop.dropped

    def job() -> object:
        with TimerDeathPenalty(1, JobTimeoutException, job_id="timed-out"):  # as RQ times out a job in a thread
            return run(engine, long)

    t0 = time.monotonic()
    t, out = in_thread(job)
    # The neighbour comes once the job's prompt is in the loop: the timeout must meet the prompt, not a
    # set-up task of the job's waiting behind the neighbour's first piece (then nothing is left to drop).
    wait_for(lambda: loop.decoding(0) or loop.dropped > dropped)
    t2, out2 = in_thread(lambda: run(other, neighbour, n=24))
    t.join(timeout=60)
    assert isinstance(out[0], JobTimeoutException), out
    assert time.monotonic() - t0 < 1 + 1.5, "the timeout reached the job only after its prompt"
    wait_for(lambda: loop.pending() <= 1 and loop.dropped == dropped + 1)
    t2.join(timeout=120)
    logits, result = out2[0]  # type: ignore[misc]
    ref_logits, ref_tokens = cold_answer(cold, neighbour, 24)
    assert np.array_equal(logits, ref_logits) and result.tokens == ref_tokens, "the neighbour of a timed-out job answered otherwise"
    assert loop.pending() == 0

    assert_retry_is_cold(engine, cold, long)


def test_a_job_timed_out_by_sigalrm_in_the_main_thread_is_dropped_and_its_retry_answers_as_cold(
    engines: list[Engine], cold: llama_cpp.Llama
) -> None:
    engine, _ = engines
    loop = engine.loaded.context.loop
    long = prompt(cold, 6, 1000)
    dropped = loop.dropped
    with pytest.raises(JobTimeoutException):
        with UnixSignalDeathPenalty(1, JobTimeoutException, job_id="timed-out"):  # sequence 0's RQ worker: the main thread
            run(engine, long)
    wait_for(lambda: loop.pending() == 0 and loop.dropped == dropped + 1)
    assert_retry_is_cold(engine, cold, long)
