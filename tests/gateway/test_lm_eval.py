"""lm-evaluation-harness's ``local-completions`` against kvpool, on the real model: a multiple-choice task scored by log-likelihood.

lm-eval posts each request's prompts as lists of token ids with ``echo``, ``logprobs`` and
``max_tokens: 1``; it tokenizes through the server (its ``remote`` tokenizer, chosen on its
own once it finds ``/tokenizer_info``), so it needs no tokenizer download. Its accuracy must
equal scoring the same items in this process with llama-cpp-python (``logits_all``).
"""

from __future__ import annotations

import json
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from tests.helpers import SMOL, THREADS, Tenancy, counter, openai_client
from worker.engine.context import flash_attn_for

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"


def loglikelihood(llm: llama_cpp.Llama, context: str, continuation: str) -> float:
    """As lm-eval splits a pair: the whole text tokenized, the context's tokens first; the continuation's logprobs summed."""
    whole = llm.tokenize((context + continuation).encode(), add_bos=False, special=True)
    n_ctx = len(llm.tokenize(context.encode(), add_bos=False, special=True))
    llm.reset()
    llm.eval(whole)
    scores = np.asarray(llm.scores[: len(whole)], dtype=np.float64)
    m = scores.max(axis=1, keepdims=True)
    logz = m[:, 0] + np.log(np.exp(scores - m).sum(axis=1))
    return float(sum(scores[i - 1, whole[i]] - logz[i - 1] for i in range(n_ctx, len(whole))))


def tokenizer_info_answers(pool: Tenancy) -> float:
    """How many ``GET /tokenizer_info`` the gateway has answered 200."""
    return counter(pool.url, "kvpool_gateway_requests_total", endpoint="/tokenizer_info", status="200")


def test_the_tokenizer_endpoints_speak_vllms_shapes_too(smol_pool) -> None:
    info = smol_pool.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>" and "im_start" in info["chat_template"]
    vllm = smol_pool.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    llama = smol_pool.post("/tokenize", json={"content": "Hello world"}).json()
    assert vllm["tokens"] == llama["tokens"] and vllm["count"] == len(vllm["tokens"]) and vllm["max_model_len"] == 2048
    assert smol_pool.post("/detokenize", json={"tokens": vllm["tokens"]}).json()["prompt"] == "Hello world"
    both = smol_pool.post("/tokenize", json={"prompt": "a", "content": "b"})
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]


def test_an_answer_that_ends_at_once_still_lists_its_end_token(smol_pool) -> None:
    """lm-eval scores ``prompt + one generated token`` and drops the last entry: an end of generation must be that entry."""
    text = "Question: Which season comes after winter?\nAnswer: spring"
    tokens = smol_pool.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = openai_client(smol_pool).completions.create(model=SMOL, prompt=tokens, echo=True, logprobs=1, max_tokens=1, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and r.usage.completion_tokens == 0  # the model ends its answer at once
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(tokens) + 1 and lp.tokens[-1] == "<|im_end|>" and lp.token_logprobs[-1] < 0
    assert choice.text == text == "".join(lp.tokens[:-1])


@pytest.mark.timeout(900)  # 64 scored prompts through lm-eval, then the same 64 in this process
def test_lm_eval_accuracy_equals_in_process_scoring(smol_pool, smollm2, monkeypatch) -> None:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the task's data file is named from the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", smol_pool.api_key)  # local-completions sends it; its tokenizer sends auth_token
    asked_before = tokenizer_info_answers(smol_pool)
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": smol_pool.url + "/v1/completions", "model": SMOL, "max_retries": 1, "auth_token": smol_pool.api_key},
        tasks=["kvpool_mc"],
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        batch_size=4,
        log_samples=True,
    )
    assert out is not None
    accuracy = out["results"]["kvpool_mc"]["acc,none"]
    assert tokenizer_info_answers(smol_pool) > asked_before  # lm-eval chose the server's own tokenizer

    docs = json.loads((TASK_DIR / "kvpool_mc.json").read_text())
    llm = llama_cpp.Llama(
        str(smollm2),
        n_ctx=512,
        n_threads=1,
        n_threads_batch=THREADS,
        verbose=False,
        logits_all=True,
        flash_attn=flash_attn_for(smollm2, None),
    )  # 2 threads crawl on a busy machine
    expected = []
    by_doc = {s["doc_id"]: s for s in out["samples"]["kvpool_mc"]}
    for i, doc in enumerate(docs):
        context = f"Question: {doc['question']}\nAnswer:"
        scores = [loglikelihood(llm, context, " " + choice) for choice in doc["choices"]]
        served = [resp[0][0] for resp in by_doc[i]["resps"]]
        assert served == pytest.approx(scores, abs=2e-3), doc["question"]
        expected.append(float(int(np.argmax(scores)) == doc["answer"]))
    assert accuracy == pytest.approx(sum(expected) / len(expected))
    assert 0 < accuracy <= 1
