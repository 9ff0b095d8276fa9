"""Sampling parameters and the tokenizer endpoints, through the official openai client and plain HTTP, on the real model."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import llama_cpp
import pytest

from gateway.tokenizer import Tokenizer
from tests.gateway.test_errors import assert_openai_error
from tests.helpers import SMOL, THREADS, cold_generate, openai_client

PROMPT = "Here is a list of fruits: apple, banana, cherry, apple, banana, cherry, apple, banana,"


@pytest.fixture(scope="module")
def smol_llm(smollm2: Path) -> llama_cpp.Llama:
    """SmolLM2 in this process, with the workers' KV layout, for cold reference runs."""
    return llama_cpp.Llama(str(smollm2), n_ctx=2048, n_threads=1, n_threads_batch=THREADS, verbose=False, flash_attn=True)


def cold_text(llm: llama_cpp.Llama, tokens: list[int], n: int, **sampling: float) -> str:
    """What a worker answers for ``tokens`` at temperature 0 with these penalties, evaluated from scratch."""
    out = cold_generate(llm, tokens, n, temp=0.0, top_k=40, top_p=1.0, min_p=0.05, repeat_penalty=1.0, **sampling)
    return llm.detokenize(out).decode("utf-8", "replace")


@pytest.mark.fp_path
def test_presence_and_frequency_penalties_are_llama_cpps_and_curb_repetition(smol_pool, smollm2, smol_llm) -> None:
    client = openai_client(smol_pool)
    tokens = Tokenizer(smollm2).tokenize(PROMPT)

    def complete(**penalties: float) -> str:
        r = client.completions.create(model=SMOL, prompt=PROMPT, max_tokens=40, temperature=0, **penalties)
        return r.choices[0].text

    plain = complete()
    penalised = complete(frequency_penalty=1.5, presence_penalty=1.0)
    assert penalised != plain
    assert penalised == cold_text(smol_llm, tokens, 40, frequency_penalty=1.5, presence_penalty=1.0)
    assert plain == cold_text(smol_llm, tokens, 40)

    def most_repeated(text: str) -> int:
        return Counter(smol_llm.tokenize(text.encode(), add_bos=False)).most_common(1)[0][1]

    assert most_repeated(penalised) < most_repeated(plain)


def test_penalties_outside_their_range_are_400(smol_pool) -> None:
    for field, value in [("presence_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", "1")]:
        body = {"model": SMOL, "messages": [{"role": "user", "content": "hi"}], field: value}
        assert_openai_error(smol_pool.post("/v1/chat/completions", json=body), 400, field)


def test_tokenize_and_detokenize_use_the_pools_exact_tokenizer(smol_pool, smollm2) -> None:
    text = "<|im_start|>Hello wörld 😀"
    vocab = llama_cpp.Llama(str(smollm2), vocab_only=True, verbose=False)

    ids = smol_pool.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids == vocab.tokenize(text.encode(), add_bos=False, special=True)
    assert ids[0] == vocab.token_bos()  # parse_special is on by default, as in llama-server
    literal = smol_pool.post("/tokenize", json={"content": text, "parse_special": False}).json()["tokens"]
    assert len(literal) > len(ids) and vocab.token_bos() not in literal

    pieces = smol_pool.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert pieces[0]["piece"] == "<|im_start|>" and pieces[1]["piece"] == "Hello"
    broken = [p["piece"] for p in pieces if isinstance(p["piece"], list)]
    assert b"".join(bytes(b) for b in broken) == " 😀".encode()  # the emoji spans two tokens, neither valid alone

    back = smol_pool.post("/detokenize", json={"tokens": ids}).json()
    assert back == {"content": text, "prompt": text}  # llama-server's field and vLLM's

    # Counting against the tokenizer gives the prompt tokens the API reports.
    client = openai_client(smol_pool)
    r = client.completions.create(model=SMOL, prompt="Count me, please.", max_tokens=1)
    counted = smol_pool.post("/tokenize", json={"content": "Count me, please.", "add_special": True, "parse_special": False}).json()[
        "tokens"
    ]
    assert r.usage.prompt_tokens == len(counted)


def test_bad_tokenizer_requests_are_openai_style_errors(smol_pool) -> None:
    assert_openai_error(smol_pool.post("/tokenize", json={"content": 5}), 400, "content")
    assert_openai_error(smol_pool.post("/tokenize", json={"content": "x", "with_pieces": "yes"}), 400, "with_pieces")
    assert_openai_error(smol_pool.post("/tokenize", json={"content": "x", "model": "gpt-9"}), 404, "gpt-9")
    surrogate = b'{"content": "a \\ud800"}'
    assert_openai_error(smol_pool.post("/tokenize", content=surrogate, headers={"content-type": "application/json"}), 400, "surrogate")
    assert_openai_error(smol_pool.post("/detokenize", json={"tokens": [1, 10**9]}), 400, "token ids")
    assert_openai_error(smol_pool.post("/detokenize", json={"tokens": ["a"]}), 400, "tokens")
    assert_openai_error(smol_pool.post("/detokenize", json={}), 400, "tokens")


def test_n_choices_are_sampled_from_one_prompt_evaluation(smol_pool) -> None:
    client = openai_client(smol_pool)
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    r = client.chat.completions.create(model=SMOL, messages=messages, n=3, temperature=1.0, seed=5, max_tokens=20, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    assert r.model_extra["kvpool"]["evaluated_tokens"] == r.usage.prompt_tokens  # once, not three times
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1
    for i, text in enumerate(texts):  # choice i is what seed + i gives alone
        alone = client.chat.completions.create(model=SMOL, messages=messages, temperature=1.0, seed=5 + i, max_tokens=20)
        assert alone.choices[0].message.content == text

    whole = client.completions.create(model=SMOL, prompt=PROMPT, n=2, temperature=0.9, seed=1, max_tokens=12)
    parts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in client.completions.create(model=SMOL, prompt=PROMPT, n=2, temperature=0.9, seed=1, max_tokens=12, stream=True):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert parts == {c.index: c.text for c in whole.choices}
    assert finished == {c.index: c.finish_reason for c in whole.choices}
