"""The answer does not depend on what was reused: cold, context reuse and store restore give the same bits.

On the real model (SmolLM2-135M-Instruct, default f16 KV layout, chunks of 256, batches
of 512), for prompts whose lengths sit on both sides of chunk and batch boundaries:
the first sampled token's logits are bit-identical, and so is the greedy continuation,
whether the prompt was evaluated from scratch, resumed from the worker's own context
(leaving one, two or three tokens to evaluate) or restored from the store, to the token,
by a worker that never saw it (full chunks plus the stored tail of the prompt). Lengths of ``k * 512 + 1`` are the cold prompts whose plain batch
split would end on a single token.

This depends on llama.cpp's CPU kernels giving the same bits for every batch of two or
more tokens, which the worker's self-check also verifies at start-up (``exact``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from gateway.pool.s3server import S3Server
from store.chain import tail_key
from store.store import Store
from tests.helpers import THREADS, s3_settings
from worker.answering import Engine
from worker.engine.llama_state import batch_sizes, last_logits
from worker.protocol import SamplingParams, TokenEvent, job_spec
from worker.settings import WorkerSettings

CHUNK = 256
LENGTHS = [255, 256, 257, 258, 511, 512, 513, 514, 767, 769, 1025]
CONTINUATION = 16

pytestmark = pytest.mark.fp_path  # answers are compared with a cold run, bit for bit or token for token


@dataclass
class Answer:
    logits: np.ndarray
    tokens: list[int]
    cached_context: int
    cached_store: int
    restore_choice: str | None = None


class Runner:
    """Runs one job on an in-process engine and keeps the logits the first token was sampled from."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def ask(self, tokens: list[int], job_waiting: Callable[[], bool] = lambda: False) -> Answer:
        seen: list[np.ndarray] = []

        def emit(_: TokenEvent) -> bool:
            if not seen:
                seen.append(last_logits(self.engine.llm))
            return True

        spec = job_spec(
            tokens,
            model=self.engine.fingerprint,
            chunk_size=CHUNK,
            sampling=SamplingParams(max_tokens=CONTINUATION, temperature=0.0, top_k=1),
        )
        result = self.engine.run(spec, emit)
        self.engine.after_answer()  # as the worker does once the answer is out
        self.engine.settle(job_waiting)
        if self.engine.publisher is not None:
            assert self.engine.publisher.wait_idle(), "publishing did not finish"
        assert seen, "no token was generated"
        return Answer(seen[0], result.tokens, result.usage.cached_from_context, result.usage.cached_from_store, result.restore_choice)


def _settings(redis_url: str, s3: S3Server, bucket: str, **kw: object) -> WorkerSettings:
    base = s3_settings(s3.endpoint_url, bucket, redis_url)
    fields = {**base.model_dump(), "chunk_size": CHUNK, "n_ctx": 2048, "n_batch": 512, "n_threads": THREADS, "settle_idle_s": 0.01, **kw}
    return WorkerSettings(**fields)


@pytest.fixture(scope="module")
def runners(smollm2: Path, redis_server, s3_server: S3Server) -> Iterator[dict[str, Runner]]:
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    settings = _settings(redis_server.url, s3_server, "kvpool-invariance")
    store = Store.open(settings)
    engines = {
        "cold": Engine.open(_settings(redis_server.url, s3_server, "kvpool-invariance", publish=False), smollm2, store=None, name="cold"),
        "reuse": Engine.open(settings, smollm2, store=store, name="reuse"),
        "restore": Engine.open(settings, smollm2, store=store, name="restore"),
    }
    yield {name: Runner(e) for name, e in engines.items()}
    for e in engines.values():
        e.close()
    store.close()


@pytest.fixture(scope="module")
def document(smollm2: Path, runners: dict[str, Runner]) -> list[int]:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    tokens = runners["cold"].engine.llm.tokenize(text.encode(), add_bos=True)
    assert len(tokens) > max(LENGTHS)
    return tokens


def test_the_worker_layout_is_exact_on_this_cpu(runners: dict[str, Runner]) -> None:
    assert all(r.engine.exact for r in runners.values()), "the self-check found restored logits differ in their bits"


@pytest.mark.parametrize("n", LENGTHS)
def test_cold_reuse_and_restore_give_the_same_bits(runners: dict[str, Runner], document: list[int], n: int) -> None:
    prompt = document[:n]
    cold_engine = runners["cold"].engine
    cold_engine.forget_context()
    cold = runners["cold"].ask(prompt)

    reuse = runners["reuse"]
    leave = 1 + LENGTHS.index(n) % 3  # the context holds all but the last 1, 2 or 3 prompt tokens
    reuse.ask(prompt[:-leave])
    reused = reuse.ask(prompt)
    assert n - max(leave, 2) <= reused.cached_context + reused.cached_store <= n - 2

    restore = runners["restore"]
    restore.engine.forget_context()
    restored = restore.ask(prompt)
    assert restored.cached_store == n - 2 and restored.cached_context == 0, "resumed at the exact token"

    for how, answer in (("context reuse", reused), ("store restore", restored)):
        assert np.array_equal(answer.logits, cold.logits), f"{how}: max |dlogit| {np.abs(answer.logits - cold.logits).max():.3g}"
        assert answer.tokens == cold.tokens, how


def test_a_resent_prompt_is_answered_alike(runners: dict[str, Runner], document: list[int]) -> None:
    """The same prompt twice in a row: the second keeps all but two cells, and answers with the same bits."""
    reuse = runners["reuse"]
    first = reuse.ask(document[:600])
    again = reuse.ask(document[:600])
    assert again.cached_context == 598
    assert np.array_equal(first.logits, again.logits) and first.tokens == again.tokens


def test_the_next_turn_resumes_after_the_completion_with_the_same_bits(runners: dict[str, Runner], document: list[int]) -> None:
    """Generated tokens were decoded exactly (`worker.engine.decoding`); published with the prompt, they serve the next turn, on any worker."""
    reuse, restore = runners["reuse"], runners["restore"]
    first = reuse.ask(document[:300])
    turn = document[:300] + first.tokens + document[300:340]
    restore.engine.forget_context()
    elsewhere = restore.ask(turn)
    assert elsewhere.cached_store == 300 + len(first.tokens) - 1, (
        "another worker resumes at the completion's last token (sampled, never decoded)"
    )
    nxt = reuse.ask(turn)
    assert nxt.cached_context + nxt.cached_store == len(turn) - 2, "the worker that saw the turn published it whole"
    runners["cold"].engine.forget_context()
    cold = runners["cold"].ask(turn)
    for answer in (nxt, elsewhere):
        assert np.array_equal(answer.logits, cold.logits) and answer.tokens == cold.tokens


@pytest.mark.parametrize(
    ("doc", "first", "second"),
    [((1100, 1500), (40, 60), (80, 95)), ((600, 1000), (100, 250), (300, 330))],
    ids=["parts-inside-a-tail", "parts-inside-a-full-chunk"],
)
def test_a_second_question_on_another_worker_resumes_where_the_prompts_part(
    runners: dict[str, Runner], document: list[int], doc: tuple[int, int], first: tuple[int, int], second: tuple[int, int]
) -> None:
    """A document asked two questions. Where the first prompt's tail, or its last full chunk (which runs past the
    document's end: 400 tokens, chunks of 256), holds the document's end, it serves the second question up to the
    token where the two prompts part."""
    reuse, restore = runners["reuse"], runners["restore"]
    text, q1, q2 = document[slice(*doc)], document[slice(*first)], document[slice(*second)]
    reuse.ask(text + q1)
    restore.engine.forget_context()
    answer = restore.ask(text + q2)
    assert answer.cached_store == len(text) + _shared(q1, q2)
    runners["cold"].engine.forget_context()
    cold = runners["cold"].ask(text + q2)
    assert np.array_equal(answer.logits, cold.logits) and answer.tokens == cold.tokens


def _shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize(
    ("n", "n_batch", "sizes"),
    [
        (1, 512, [1]),
        (2, 512, [2]),
        (512, 512, [512]),
        (513, 512, [511, 2]),
        (1025, 512, [512, 511, 2]),
        (700, 512, [512, 188]),
        (7, 3, [3, 2, 2]),
    ],
)
def test_batch_sizes_never_end_on_a_lone_token(n: int, n_batch: int, sizes: list[int]) -> None:
    assert batch_sizes(n, n_batch) == sizes and sum(sizes) == n


def test_batches_of_under_three_tokens_are_refused() -> None:
    with pytest.raises(ValueError):
        batch_sizes(10, 2)


def test_a_tail_alone_is_copied_only_once_the_answer_is_out(runners: dict[str, Runner], document: list[int]) -> None:
    """Full chunks go out at the first token; a prompt that adds only a tail leaves the state copy for after the
    answer, when the tail goes out with the answer's cells (it serves a resend of the prompt as well)."""
    runner = runners["reuse"]
    engine = runner.engine
    assert engine.publisher is not None
    runner.ask(document[: 2 * CHUNK + 10])  # both full chunks are in the store now
    prompt = document[: 2 * CHUNK] + document[3 * CHUNK : 3 * CHUNK + 40]  # a tail no stored tail shares a token with
    ns = engine.namespace("")
    keys = ns.chain(prompt)
    spec = job_spec(prompt, model=engine.fingerprint, chunk_size=CHUNK, sampling=SamplingParams(max_tokens=2, temperature=0.0))
    held = prompt + engine.run(spec, lambda _: True).tokens[:-1]  # the answer's last token is sampled, never decoded
    tails = [tail_key(ns.parent_of(keys, len(keys)), t[len(keys) * CHUNK :]) for t in (prompt, held)]
    assert engine.publisher.wait_idle()
    assert engine.publisher.store.index.present(tails) == [False, False], "nothing was copied on the token path"
    engine.after_answer()
    assert engine.publisher.wait_idle()
    assert engine.publisher.store.index.present(tails[1:]) == [True]
    runners["restore"].engine.forget_context()
    assert runners["restore"].ask(prompt).cached_store == len(prompt) - 2, "another worker resumes the prompt from it"
