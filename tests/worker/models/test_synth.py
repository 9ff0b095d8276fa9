"""Specification of the generated random-weight llama models and their tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import jinja2
import llama_cpp
import numpy as np
import pytest
from click.testing import CliRunner

from worker.cli import model_group
from worker.models.synth import CHAT_TEMPLATE, SIZES, ensure_model, make_model
from worker.models.vocab import SAMPLE_TEXT

ROUND_TRIP_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, trailing space ",
    "Punctuation: (a) [b] {c} <d> \"quoted\" 'single' -- 50% off! #1 @home ~/x?",
    "Digits 0123456789 and 3.14159, 1,000,000 and 2024-05-17.",
    "line one\nline two\n\n\ttabbed\r\nwindows line\n",
    "naïve café 日本語 🙂",
    "Ünïcödé → ∑ ≠ ∞, Ελληνικά, русский, עברית, 👩‍💻🇫🇷",
    "<s> and </s> and <unk> are only text here",
    "<|im_start|>user\nHi!<|im_end|>\n",
    "",
]


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}


def _last_logits(llm: llama_cpp.Llama, tokens: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(tokens)
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float64)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model("tiny", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def llm(model_path: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(model_path), n_ctx=512, logits_all=False, verbose=False)


def test_same_seed_gives_identical_bytes(tmp_path: Path) -> None:
    a = make_model("tiny", tmp_path / "a.gguf", seed=7)
    b = make_model(SIZES["tiny"], tmp_path / "b.gguf", seed=7)
    assert a.read_bytes() == b.read_bytes()


def test_different_seed_gives_different_weights_and_same_tokenizer(tmp_path: Path, model_path: Path) -> None:
    other = make_model("tiny", tmp_path / "s1.gguf", seed=1)
    w0, w1 = _tensors(model_path), _tensors(other)
    assert w0.keys() == w1.keys()
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "output.weight"):
        assert not np.array_equal(w0[name], w1[name]), name
    np.testing.assert_array_equal(w0["output_norm.weight"], w1["output_norm.weight"])
    tok0 = gguf.GGUFReader(model_path).fields["tokenizer.ggml.tokens"]
    tok1 = gguf.GGUFReader(other).fields["tokenizer.ggml.tokens"]
    assert [bytes(tok0.parts[i]) for i in tok0.data] == [bytes(tok1.parts[i]) for i in tok1.data]


def test_ensure_model_names_and_caches_the_file(tmp_path: Path) -> None:
    path = ensure_model("tiny", tmp_path, seed=3)
    assert path == tmp_path / "kvpool-tiny-s3.gguf"
    before = path.stat()
    assert ensure_model("tiny", tmp_path, seed=3) == path
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvpool-tiny-s3.gguf"]


def test_tiny_is_small_gqa_with_head_size_64(model_path: Path) -> None:
    spec = SIZES["tiny"]
    assert spec.head_dim == 64 and spec.n_head_kv < spec.n_head
    assert spec.n_ctx_train >= 4096
    assert 1 < model_path.stat().st_size / 1e6 < 16


def test_f32_variant_stores_f32_matrices_and_loads(tmp_path: Path) -> None:
    spec = dataclasses.replace(SIZES["tiny"], dtype="f32")
    path = make_model(spec, tmp_path / "f32.gguf")
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F32
    assert types["output.weight"] == gguf.GGMLQuantizationType.F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False)
    assert np.isfinite(_last_logits(llm, llm.tokenize(b"Hello world"))).all()


def test_bench_is_tinyllama_sized() -> None:
    spec = SIZES["bench"]
    assert (spec.n_embd, spec.n_layer, spec.n_head, spec.n_head_kv, spec.n_ff, spec.n_vocab) == (
        2048,
        22,
        32,
        4,
        5632,
        32000,
    )
    assert spec.dtype == "f16"
    assert 1.0e9 < spec.n_params < 1.2e9


def test_loads_in_llama_cpp_with_expected_metadata(llm: llama_cpp.Llama) -> None:
    meta = llm.metadata
    spec = SIZES["tiny"]
    assert meta["general.architecture"] == "llama"
    assert meta["general.name"] == "kvpool-tiny"
    assert meta["tokenizer.ggml.model"] == "llama"
    n_head, n_head_kv = int(meta["llama.attention.head_count"]), int(meta["llama.attention.head_count_kv"])
    assert n_head_kv < n_head
    assert int(meta["llama.embedding_length"]) // n_head == 64
    assert int(meta["llama.rope.dimension_count"]) == 64
    assert int(meta["llama.context_length"]) == spec.n_ctx_train
    assert llm.n_vocab() == spec.n_vocab
    assert (llm.token_bos(), llm.token_eos()) == (1, 2)
    assert meta["tokenizer.ggml.add_bos_token"] == "true"


def test_output_projection_is_untied(model_path: Path) -> None:
    weights = _tensors(model_path)
    assert weights["output.weight"].shape == weights["token_embd.weight"].shape
    assert not np.array_equal(weights["output.weight"], weights["token_embd.weight"])


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_utf8(llm: llama_cpp.Llama, text: str) -> None:
    ids = llm.tokenize(text.encode(), add_bos=False)
    assert llm.detokenize(ids) == text.encode()


def test_tokenizer_adds_bos_on_request(llm: llama_cpp.Llama) -> None:
    assert llm.tokenize(b"Hello", add_bos=True)[0] == llm.token_bos()
    assert llm.token_bos() not in llm.tokenize(b"Hello", add_bos=False)


def test_common_english_words_are_single_tokens(llm: llama_cpp.Llama) -> None:
    text = "The quick brown fox jumps over the lazy dog. The computer stores data in memory."
    ids = llm.tokenize(text.encode(), add_bos=False)
    assert len(ids) <= len(text) // 4
    for word in (" the", " and", " computer", " people", " question"):
        assert len(llm.tokenize(word.encode(), add_bos=False)) == 1, word


def test_changing_the_first_token_changes_the_final_logits(llm: llama_cpp.Llama) -> None:
    """The prefix must matter: otherwise KV-cache correctness tests would prove nothing."""
    _assert_the_first_token_matters(llm)


def test_tiny_swa_is_a_sliding_window_model_whose_prefix_matters(tmp_path_factory: pytest.TempPathFactory) -> None:
    """120-token prompts run far past its 32-token window: only its global layer sees the first token."""
    from worker.engine.kvcache import context_cache

    path = ensure_model("tiny-swa", tmp_path_factory.mktemp("models"))
    swa = llama_cpp.Llama(str(path), n_ctx=512, n_threads=1, verbose=False)
    assert swa.metadata["general.architecture"] == "cohere2"
    assert llama_cpp.llama_model_n_swa(swa.model) == SIZES["tiny-swa"].sliding_window == 32
    layout = context_cache(swa)
    assert not layout.cuttable and "sliding-window" in (layout.reason or "")
    _assert_the_first_token_matters(swa)


def test_tiny_ssm_is_a_recurrent_model_whose_prefix_matters(tmp_path_factory: pytest.TempPathFactory) -> None:
    from worker.engine.kvcache import context_cache

    path = ensure_model("tiny-ssm", tmp_path_factory.mktemp("models"))
    ssm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=1, verbose=False)
    assert ssm.metadata["general.architecture"] == "mamba"
    assert llama_cpp.llama_model_is_recurrent(ssm.model)
    layout = context_cache(ssm)
    assert not layout.cuttable and not layout.prefix_reuse and "recurrent" in (layout.reason or "")
    _assert_the_first_token_matters(ssm)


def test_tiny_hybrid_is_a_jamba_model_of_mamba_and_attention_layers_whose_prefix_matters(tmp_path_factory: pytest.TempPathFactory) -> None:
    from worker.engine.kvcache import context_cache

    path = ensure_model("tiny-hybrid", tmp_path_factory.mktemp("models"))
    hybrid = llama_cpp.Llama(str(path), n_ctx=512, n_threads=1, verbose=False)
    assert hybrid.metadata["general.architecture"] == "jamba"
    assert llama_cpp.llama_model_is_hybrid(hybrid.model) and not llama_cpp.llama_model_is_recurrent(hybrid.model)
    layout = context_cache(hybrid)
    assert not layout.cuttable and not layout.prefix_reuse and layout.checkpoints and "hybrid" in (layout.reason or "")
    _assert_the_first_token_matters(hybrid)


def _assert_the_first_token_matters(llm: llama_cpp.Llama) -> None:
    corpus = llm.tokenize(SAMPLE_TEXT.encode(), add_bos=False)
    rng = np.random.default_rng(0)
    n_prompts, flips, diffs = 8, 0, []
    for _ in range(n_prompts):
        start = int(rng.integers(0, len(corpus) - 120))
        prompt = [llm.token_bos(), *corpus[start : start + 120]]
        changed = [prompt[0], (prompt[1] + 500) % llm.n_vocab(), *prompt[2:]]
        a, b = _last_logits(llm, prompt), _last_logits(llm, changed)
        assert np.isfinite(a).all() and a.std() > 0.5
        assert a.argmax() != prompt[-1]
        diffs.append(float(np.abs(a - b).max()))
        flips += a.argmax() != b.argmax()
        np.testing.assert_array_equal(a, _last_logits(llm, prompt))
    assert min(diffs) > 0.5, diffs
    assert flips >= n_prompts // 4


def test_chat_template_renders_chatml(llm: llama_cpp.Llama) -> None:
    template = llm.metadata["tokenizer.chat_template"]
    assert template == CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    rendered = (
        jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    )
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    for marker in ("<|im_start|>", "<|im_end|>"):
        assert len(llm.tokenize(marker.encode(), add_bos=False)) <= 2
    assert llm.detokenize(llm.tokenize(rendered.encode(), add_bos=True)) == rendered.encode()


def test_cli_make_writes_model_and_reports_it(tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    result = CliRunner().invoke(model_group, ["make", "--size", "tiny", "--seed", "5", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == make_model("tiny", tmp_path / "direct.gguf", seed=5).read_bytes()
    assert str(out) in result.output
    assert "MB" in result.output and f"{SIZES['tiny'].n_params:,}" in result.output


def test_a_model_with_another_models_tokenizer_reads_prompts_token_for_token_as_that_model(tmp_path: Path, smollm2: Path) -> None:
    out = tmp_path / "like.gguf"
    result = CliRunner().invoke(model_group, ["make", "--size", "tiny-long", "--tokenizer-from", str(smollm2), "--out", str(out)])
    assert result.exit_code == 0, result.output
    real = llama_cpp.Llama(model_path=str(smollm2), vocab_only=True, verbose=False)
    like = llama_cpp.Llama(model_path=str(out), n_ctx=64, verbose=False)
    assert (
        like.n_vocab() == real.n_vocab() == 49152
        and f"{dataclasses.replace(SIZES['tiny-long'], n_vocab=49152).n_params:,}" in result.output
    )
    assert like.metadata["tokenizer.chat_template"] == real.metadata["tokenizer.chat_template"]
    for text in [*ROUND_TRIP_TEXTS, '<|im_start|>assistant\n{"tool_call": {}}<|im_end|>']:
        assert like.tokenize(text.encode(), add_bos=False, special=True) == real.tokenize(text.encode(), add_bos=False, special=True)
    fields = gguf.GGUFReader(out).fields
    assert [int(fields[f"llama.{k}"].contents()) for k in ("block_count", "embedding_length", "context_length")] == [1, 64, 32768]
    assert len(like.tokenize(b"hi")) and np.isfinite(_last_logits(like, like.tokenize(b"Hello world"))).all()

    not_a_model = tmp_path / "notes.gguf"
    not_a_model.write_text("hello")
    refused = CliRunner().invoke(model_group, ["make", "--tokenizer-from", str(not_a_model), "--out", str(tmp_path / "x.gguf")])
    assert refused.exit_code == 1 and "GGUF magic invalid" in refused.output and not (tmp_path / "x.gguf").exists()
