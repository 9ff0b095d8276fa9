"""Completions as evaluation harnesses use them: echo with prompt logprobs, several prompts per request; on the real model."""

from __future__ import annotations

import math
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from gateway.tokenizer import Tokenizer
from tests.helpers import SMOL, THREADS, openai_client, prompt_text
from worker.engine.context import flash_attn_for

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATIONS = [" Paris", " London", " a big cheese"]


def reference_logprobs(model: Path, tokens: list[int]) -> list[float]:
    """Each token's logprob under the ones before it, from a plain llama.cpp evaluation with every position's logits."""
    llm = llama_cpp.Llama(
        str(model), n_ctx=2048, n_threads=1, n_threads_batch=THREADS, verbose=False, logits_all=True, flash_attn=flash_attn_for(model, None)
    )
    llm.eval(tokens)
    scores = np.asarray(llm.scores[: len(tokens)], dtype=np.float64)
    m = scores.max(axis=1, keepdims=True)
    logz = m[:, 0] + np.log(np.exp(scores - m).sum(axis=1))
    return [float(scores[i - 1, tokens[i]] - logz[i - 1]) for i in range(1, len(tokens))]


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(smol_pool, smollm2) -> None:
    """lm-eval's local-completions: prompt = context + continuation, echo, max_tokens 0, logprobs 1."""
    client = openai_client(smol_pool)
    tok = Tokenizer(smollm2)
    ctx = tok.tokenize(CONTEXT)
    scores = {}
    for cont in CONTINUATIONS:
        tokens = tok.tokenize(CONTEXT + cont)
        r = client.completions.create(model=SMOL, prompt=tokens, echo=True, max_tokens=0, logprobs=1, temperature=0)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(tokens) == r.usage.prompt_tokens and r.usage.completion_tokens == 0
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has none
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        assert lp.token_logprobs[1:] == pytest.approx(reference_logprobs(smollm2, tokens), abs=1e-3)
        assert r.choices[0].text == "".join(lp.tokens) == tok.llm.detokenize(tokens).decode()
        scores[cont] = sum(lp.token_logprobs[len(ctx) :])
        assert all(len(top) == 1 and max(top.values()) >= x for top, x in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    assert max(scores, key=scores.get) == " Paris"


@pytest.mark.fp_path
def test_prompt_logprobs_are_the_cold_ones_whatever_the_pool_holds(smol_pool, smollm2) -> None:
    client = openai_client(smol_pool)
    document = prompt_text(41, 300)
    scored = client.completions.create(model=SMOL, prompt=document + " first", echo=True, max_tokens=0, logprobs=2)
    plain = client.completions.create(model=SMOL, prompt=document + " second", max_tokens=4, temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0  # the scored prompt left its prefix behind
    again = client.completions.create(model=SMOL, prompt=document + " first", echo=True, max_tokens=0, logprobs=2)
    assert again.model_extra["kvpool"]["evaluated_tokens"] == again.usage.prompt_tokens  # scored from the start
    assert again.choices[0].logprobs.token_logprobs == scored.choices[0].logprobs.token_logprobs
    assert again.choices[0].logprobs.top_logprobs == scored.choices[0].logprobs.top_logprobs

    # Scoring does not change what is generated after the prompt.
    with_echo = client.completions.create(model=SMOL, prompt=document + " second", max_tokens=4, temperature=0, echo=True, logprobs=0)
    assert with_echo.choices[0].text == document + " second" + plain.choices[0].text
    n_prompt = with_echo.usage.prompt_tokens
    assert len(with_echo.choices[0].logprobs.tokens) == n_prompt + with_echo.usage.completion_tokens


def test_echo_without_logprobs_puts_the_prompt_before_the_answer(smol_pool) -> None:
    client = openai_client(smol_pool)
    plain = client.completions.create(model=SMOL, prompt=CONTEXT, max_tokens=6, temperature=0)
    echoed = client.completions.create(model=SMOL, prompt=CONTEXT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == CONTEXT + plain.choices[0].text
    streamed = client.completions.create(model=SMOL, prompt=CONTEXT, max_tokens=6, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


def test_several_prompts_in_one_request_give_their_choices_in_order(smol_pool, smollm2) -> None:
    client = openai_client(smol_pool)
    texts = ["The sky is", "Water boils at", "My favourite food is"]
    r = client.completions.create(model=SMOL, prompt=texts, n=2, max_tokens=8, temperature=0.8, seed=3)
    assert [c.index for c in r.choices] == list(range(6))
    singles = [client.completions.create(model=SMOL, prompt=t, n=2, max_tokens=8, temperature=0.8, seed=3) for t in texts]
    assert [c.text for c in r.choices] == [c.text for s in singles for c in s.choices]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert len(r.model_extra["kvpool"]["prompts"]) == 3

    tok = Tokenizer(smollm2)
    by_ids = client.completions.create(model=SMOL, prompt=[tok.tokenize(t) for t in texts], n=2, max_tokens=8, temperature=0.8, seed=3)
    assert [c.text for c in by_ids.choices] == [c.text for c in r.choices]

    parts: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(
        model=SMOL, prompt=texts, n=2, max_tokens=8, temperature=0.8, seed=3, stream=True, stream_options={"include_usage": True}
    ):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert parts == {c.index: c.text for c in r.choices}
    assert usage is not None and usage.total_tokens == r.usage.total_tokens
    assert math.isclose(usage.prompt_tokens, r.usage.prompt_tokens)
