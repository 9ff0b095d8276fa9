"""Specification of restoring joined chunk payloads into llama.cpp, against the real tiny model.

A restored prefix plus a cold evaluation of the rest must behave like a cold evaluation
of the whole prompt: the same next token, logits within the cold path's own batching
noise, and the same greedy continuation wherever the cold run's choice is decisive.

The tiny model has random weights, so its distributions are nearly flat, and noise of a
few 1e-3 (another cell order, another batch split) may flip a later argmax on one CPU and
not on another. The greedy continuation is therefore compared only up to the first step
whose top-two margin in the cold run lies within a few times the measured noise. The
same check on a trained model, where greedy answers are stable and logits are compared
bit for bit, is ``test_invariance.py``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from tests.helpers import THREADS
from worker.cache.kvchunks import cut_state, join_state
from worker.engine.context import open_llama
from worker.engine.kvcache import cache_type_id, context_cache
from worker.engine.kvstate import StateFormatError, describe_state
from worker.engine.llama_state import StateRestoreError, read_seq_state, restore_seq_state

CONFIGS = [("f16", False), ("f16", True), ("q8_0", True)]
CONFIG_IDS = ["f16-noFA", "f16-FA", "q8_0-FA"]
PROMPT = [1] + np.random.default_rng(11).integers(3, 2048, 199).tolist()
PROMPT_LENS = [128, 150]  # a multiple of every chunk size, and not
CONTINUATION = 32
NOISE_FLOOR = 1e-3
DECISIVE = 8
"""A greedy step counts as decisive when its top-two margin exceeds this many times the first step's observed noise."""


def _logits(llm: llama_cpp.Llama) -> np.ndarray:
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float64)


def _greedy(llm: llama_cpp.Llama, n: int) -> tuple[list[int], list[float]]:
    """The greedy continuation, and at each step the margin between the best two logits."""
    out, margins = [], []
    for _ in range(n):
        logits = _logits(llm)
        top2 = np.partition(logits, -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
        out.append(int(np.argmax(logits)))
        llm.eval(out[-1:])
    return out, margins


def _pos_range(llm: llama_cpp.Llama) -> tuple[int, int]:
    mem = llama_cpp.llama_get_memory(llm.ctx)
    return llama_cpp.llama_memory_seq_pos_min(mem, 0), llama_cpp.llama_memory_seq_pos_max(mem, 0)


@dataclass
class Cold:
    logits: np.ndarray
    continuation: list[int]
    margins: list[float]
    state: bytes
    noise: float

    @property
    def bound(self) -> float:
        """Allowed max |logit difference|: a few times the cold path's own batching noise."""
        return max(4 * self.noise, NOISE_FLOOR)


class Models:
    """Llama instances for the tests: reused sources for cold runs, fresh ones for restores."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._cold: dict[tuple[str, bool, int], Cold] = {}
        self._open: list[llama_cpp.Llama] = []

    def fresh(self, cache: str, fa: bool, **kwargs: object) -> llama_cpp.Llama:
        llm = open_llama(self.path, flash_attn=fa, type_k=cache, n_threads=THREADS, n_threads_batch=THREADS, **kwargs)
        self._open.append(llm)
        return llm

    def cold(self, cache: str, fa: bool, n: int) -> Cold:
        key = (cache, fa, n)
        if key not in self._cold:
            small = self.fresh(cache, fa, n_batch=32)
            small.eval(PROMPT[:n])
            llm = self.fresh(cache, fa)
            llm.eval(PROMPT[:n])
            logits = _logits(llm)
            noise = float(np.abs(logits - _logits(small)).max())
            state = read_seq_state(llm)
            self._cold[key] = Cold(logits, *_greedy(llm, CONTINUATION), state, noise)
            # The comparison has power: changing one early token moves the logits far past the bound.
            llm.reset()
            llm.eval([PROMPT[0], PROMPT[1] + 1] + PROMPT[2:n])
            assert np.abs(_logits(llm) - logits).max() > 10 * self._cold[key].bound
        return self._cold[key]

    def close(self) -> None:
        for llm in self._open:
            llm.close()


@pytest.fixture(scope="module")
def models(tiny_model: Path) -> Iterator[Models]:
    m = Models(tiny_model)
    yield m
    m.close()


def _assert_matches_cold(llm: llama_cpp.Llama, cold: Cold, bound: float | None = None) -> float:
    logits = _logits(llm)
    diff = float(np.abs(logits - cold.logits).max())
    assert int(np.argmax(logits)) == int(np.argmax(cold.logits))
    bound = cold.bound if bound is None else bound
    assert diff <= bound, f"max |dlogit| {diff:.4g}, noise {cold.noise:.4g}"
    noise = max(diff, NOISE_FLOOR)
    decisive = next((i for i, m in enumerate(cold.margins) if m <= DECISIVE * noise), len(cold.margins))
    assert _greedy(llm, CONTINUATION)[0][:decisive] == cold.continuation[:decisive], f"decisive steps: {decisive}"
    return diff


@pytest.mark.parametrize(("cache", "fa"), CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("n", PROMPT_LENS)
def test_restored_prefix_continues_like_a_cold_prompt(models: Models, cache: str, fa: bool, chunk: int, n: int) -> None:
    cold = models.cold(cache, fa, n)
    k = (n - 1) // chunk  # leave at least the last prompt token to evaluate
    payloads = cut_state(cold.state, chunk, 0, k)
    llm = models.fresh(cache, fa)
    restore_seq_state(llm, join_state(payloads, v_trans=not fa), PROMPT[: k * chunk])
    assert llm.n_tokens == k * chunk and _pos_range(llm) == (0, k * chunk - 1)
    llm.eval(PROMPT[k * chunk : n])
    assert _pos_range(llm) == (0, n - 1)
    _assert_matches_cold(llm, cold)


@pytest.mark.parametrize(("src_fa", "dst_fa"), [(False, True), (True, False)])
def test_chunks_serve_the_other_v_layout(models: Models, src_fa: bool, dst_fa: bool) -> None:
    """Payloads cut with flash attention off restore into a context with it on, and back.

    The K/V values themselves were computed by the other attention path, so the bound
    also allows for the cold difference between the two paths.
    """
    n, chunk = 150, 32
    src, dst = models.cold("f16", src_fa, n), models.cold("f16", dst_fa, n)
    paths = float(np.abs(src.logits - dst.logits).max())
    llm = models.fresh("f16", dst_fa)
    restore_seq_state(llm, join_state(cut_state(src.state, chunk, 0, 4), v_trans=not dst_fa), PROMPT[:128])
    llm.eval(PROMPT[128:n])
    _assert_matches_cold(llm, dst, bound=max(4 * (paths + dst.noise), NOISE_FLOOR))


def _decode(ctx: llama_cpp.llama_context_p, tokens: list[int], pos0: int, seq_id: int) -> None:
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, tok in enumerate(tokens):
            batch.token[i] = tok
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = i == len(tokens) - 1
        assert llama_cpp.llama_decode(ctx, batch) == 0
    finally:
        llama_cpp.llama_batch_free(batch)


@pytest.mark.parametrize(("cache", "fa"), CONFIGS, ids=CONFIG_IDS)
def test_cells_out_of_position_order_are_cut_by_position(models: Models, cache: str, fa: bool) -> None:
    """Two sequences sharing one cache stream leave sequence 0's cells out of position order."""
    n = 150
    cold = models.cold(cache, fa, n)
    owner = models.fresh(cache, fa)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 512, 512, 512
    params.n_seq_max, params.kv_unified = 2, True
    params.n_threads = params.n_threads_batch = 2
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.type_k = params.type_v = cache_type_id(cache)
    ctx = llama_cpp.llama_init_from_model(owner.model, params)
    assert ctx is not None
    try:
        mem = llama_cpp.llama_get_memory(ctx)
        _decode(ctx, PROMPT[0:32], 0, seq_id=0)  # cells 0..31
        _decode(ctx, PROMPT[100:132], 0, seq_id=1)  # cells 32..63
        _decode(ctx, PROMPT[32:64], 32, seq_id=0)  # cells 64..95
        llama_cpp.llama_memory_seq_rm(mem, 1, -1, -1)
        _decode(ctx, PROMPT[64:96], 64, seq_id=0)  # cells 32..63 again
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        assert llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0) == size
        state = bytes(buf)
        # Continuing in place shows how far this cache's own arithmetic strays from the cold run.
        _decode(ctx, PROMPT[96:n], 96, seq_id=0)
        in_place = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(owner.n_vocab(),))
        in_place_noise = float(np.abs(in_place.astype(np.float64) - cold.logits).max())
    finally:
        llama_cpp.llama_free(ctx)

    info = describe_state(state)
    assert (info.n_cells, info.in_order, info.contiguous) == (96, False, True)
    llm = models.fresh(cache, fa)
    restore_seq_state(llm, join_state(cut_state(state, 32), v_trans=not fa), PROMPT[:96])
    llm.eval(PROMPT[96:n])
    _assert_matches_cold(llm, cold, bound=max(4 * max(cold.noise, in_place_noise), NOISE_FLOOR))


# --- pitfalls ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_fa(models: Models) -> llama_cpp.Llama:
    return models.fresh("f16", False)


def _assert_cleared(llm: llama_cpp.Llama) -> None:
    assert _pos_range(llm) == (-1, -1)
    assert llm.n_tokens == 0


def test_a_join_without_chunk_0_is_refused_though_llama_cpp_would_load_it(models: Models, no_fa: llama_cpp.Llama) -> None:
    cold = models.cold("f16", False, 150)
    payloads = cut_state(cold.state, 16, 0, 8)
    with pytest.raises(StateFormatError):
        join_state(payloads[1:], v_trans=True)

    # llama.cpp itself takes a state whose positions start at 16 and decodes garbage from it.
    source = models.fresh("f16", False)
    source.eval(PROMPT[:128])
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(source.ctx), 0, 0, 16)
    headless = read_seq_state(source)
    assert describe_state(headless).pos_min == 16
    with pytest.raises(StateRestoreError, match="positions"):
        restore_seq_state(no_fa, headless, PROMPT[16:128])
    with pytest.raises(StateRestoreError, match="cells"):
        restore_seq_state(no_fa, headless, PROMPT[:128])
    _assert_cleared(no_fa)
    restore_seq_state(no_fa, headless, PROMPT[:128], check=False)
    no_fa.eval(PROMPT[128:150])
    assert np.abs(_logits(no_fa) - cold.logits).max() > 10 * cold.bound


@pytest.mark.parametrize("check", [True, False])
def test_a_truncated_state_raises_and_leaves_the_sequence_empty(models: Models, no_fa: llama_cpp.Llama, check: bool) -> None:
    state = models.cold("f16", False, 128).state
    no_fa.reset()
    no_fa.eval(PROMPT[:20])
    with pytest.raises(StateRestoreError):
        restore_seq_state(no_fa, state[:-100], PROMPT[:128], check=check)
    _assert_cleared(no_fa)


def test_trailing_bytes_are_not_a_full_load(models: Models, no_fa: llama_cpp.Llama) -> None:
    state = models.cold("f16", False, 128).state
    with pytest.raises(StateRestoreError, match="trailing"):
        restore_seq_state(no_fa, state + b"\0" * 8, PROMPT[:128], check=False)
    _assert_cleared(no_fa)


def test_a_state_for_the_other_v_layout_is_refused(models: Models) -> None:
    cold = models.cold("f16", False, 128)
    fa = models.fresh("f16", True)
    transposed = join_state(cut_state(cold.state, 32), v_trans=True)
    with pytest.raises(StateRestoreError):
        restore_seq_state(fa, transposed, PROMPT[:128])
    _assert_cleared(fa)
    # The context is still usable afterwards.
    fa.eval(PROMPT[:128])
    assert int(np.argmax(_logits(fa))) == int(np.argmax(models.cold("f16", True, 128).logits))


def test_the_token_count_must_match_the_state(models: Models, no_fa: llama_cpp.Llama) -> None:
    state = models.cold("f16", False, 128).state
    with pytest.raises(StateRestoreError, match="cells"):
        restore_seq_state(no_fa, state, PROMPT[:127])
    _assert_cleared(no_fa)


def test_restore_accepts_any_buffer(models: Models, no_fa: llama_cpp.Llama) -> None:
    cold = models.cold("f16", False, 150)
    for buf in (bytearray(cold.state), memoryview(cold.state)):
        restore_seq_state(no_fa, buf, PROMPT[:150])
        assert _pos_range(no_fa) == (0, 149)
        assert list(no_fa.input_ids[:150]) == PROMPT[:150]


# --- layout facts -------------------------------------------------------------------------


@pytest.mark.parametrize(("cache", "fa"), CONFIGS, ids=CONFIG_IDS)
def test_kv_layout_predicts_the_state(models: Models, cache: str, fa: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE", raising=False)
    llm = models.fresh(cache, fa)
    layout = context_cache(llm)
    assert (layout.type_k, layout.type_v, layout.flash_attn, layout.v_trans) == (
        cache_type_id(cache),
        cache_type_id(cache),
        fa,
        not fa,
    )
    assert (layout.n_layer, layout.n_embd_k_gqa, layout.n_embd_v_gqa) == (4, 128, 128)
    assert layout.cuttable and layout.reason is None
    assert layout.attn_rot_k == layout.attn_rot_v == (cache == "q8_0")
    info = describe_state(models.cold(cache, fa, 128).state)
    assert info.layout == layout.state_layout and info.v_trans == layout.v_trans
    assert layout.bytes_per_token == {"f16": 12 + 4 * 2 * 256, "q8_0": 12 + 4 * 2 * 136}[cache]


def test_attention_rotation_changes_a_quantized_cache(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LLAMA_ATTN_ROT_DISABLE is a setting that changes q8_0 bytes, so it belongs in the chunk key."""
    states, rot = [], []
    for disable in ("0", "1"):
        monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", disable)
        llm = open_llama(tiny_model, flash_attn=True, type_k="q8_0", n_threads=THREADS, n_threads_batch=THREADS)
        llm.eval(PROMPT[:32])
        states.append(read_seq_state(llm))
        rot.append(context_cache(llm).attn_rot_k)
        llm.close()
    assert rot == [True, False]
    assert len(states[0]) == len(states[1]) and states[0] != states[1]


def test_open_llama_refuses_quantized_v_without_flash_attention(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="flash attention"):
        open_llama(tiny_model, flash_attn=False, type_k="q8_0")
    with pytest.raises(ValueError):
        cache_type_id("q3_k")


def test_a_sequence_function_given_neither_a_context_nor_a_view_names_what_it_got() -> None:
    with pytest.raises(TypeError, match="not a context or a sequence view: str"):
        read_seq_state("a context")  # type: ignore[arg-type]
