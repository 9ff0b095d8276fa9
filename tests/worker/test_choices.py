"""n choices from one evaluated prompt: each samples its first token from the cold logits, bit for bit.

The prompt is evaluated (or restored) once; each further choice evaluates only the last
two prompt tokens again. Choice i of a seeded job is the answer a one-choice job with
seed + i gives.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gateway.tokenizer import Tokenizer
from tests.helpers import THREADS, prompt_text
from worker.answering import Engine
from worker.engine.llama_state import last_logits
from worker.protocol import JobResult, SamplingParams, TokenEvent, job_spec
from worker.settings import WorkerSettings

pytestmark = pytest.mark.fp_path

CHUNK = 64


@pytest.fixture(scope="module")
def engines(smollm2: Path) -> Iterator[dict[str, Engine]]:
    settings = WorkerSettings(chunk_size=CHUNK, n_ctx=2048, n_threads=THREADS, publish=False, self_check=False, settle_completions=False)
    made = {name: Engine.open(settings, smollm2, store=None, name=name) for name in ("many", "cold")}
    yield made
    for e in made.values():
        e.close()


def run(engine: Engine, tokens: list[int], **sampling: object) -> tuple[JobResult, dict[int, np.ndarray]]:
    """Runs a job; returns its result and, per choice, the logits its first token was sampled from."""
    firsts: dict[int, np.ndarray] = {}

    def emit(ev: TokenEvent) -> bool:
        if ev.token >= 0 and ev.index not in firsts:
            firsts[ev.index] = last_logits(engine.llm)
        return True

    spec = job_spec(tokens, model=engine.fingerprint, chunk_size=CHUNK, sampling=SamplingParams(**{"max_tokens": 12, **sampling}))
    return engine.run(spec, emit), firsts


@pytest.mark.parametrize("words", [40, 130])
def test_every_choice_starts_from_the_cold_logits_and_matches_its_own_seed(engines, smollm2, words: int) -> None:
    tokens = Tokenizer(smollm2).tokenize(prompt_text(words, words))
    many, firsts = run(engines["many"], tokens, n=3, temperature=1.2, seed=11)
    assert many.usage.prompt_tokens == len(tokens)
    assert many.usage.completion_tokens == len(many.tokens) + sum(len(c.tokens) for c in many.extra_choices)
    assert [c.index for c in many.extra_choices] == [1, 2]
    assert sorted(firsts) == [0, 1, 2]

    choices = [many.tokens, *(c.tokens for c in many.extra_choices)]
    for i, got in enumerate(choices):
        alone, cold_first = run(engines["cold"], tokens, n=1, temperature=1.2, seed=11 + i)
        engines["cold"].forget_context()  # the next reference starts cold too
        assert np.array_equal(firsts[i], cold_first[0]), f"choice {i} sampled from other logits than a cold evaluation"
        assert got == alone.tokens
    assert len({tuple(c) for c in choices}) > 1, "seeds seed + i should give different choices"


def test_greedy_choices_are_identical(engines, smollm2) -> None:
    tokens = Tokenizer(smollm2).tokenize(prompt_text(3, 60))
    result, _ = run(engines["many"], tokens, n=2, temperature=0.0)
    assert result.extra_choices[0].tokens == result.tokens
    assert result.extra_choices[0].text == result.text
