"""The start-up check passes on every supported layout and fails, rather than trusting, a wrong assembly."""

from dataclasses import replace

import pytest

from tests.helpers import THREADS
from worker.engine.context import open_llama
from worker.engine.kvcache import context_cache
from worker.startup.selfcheck import check_restore


@pytest.mark.parametrize("flash_attn,cache", [(False, "f16"), (True, "f16"), (True, "q8_0")], ids=["f16", "f16-flash", "q8_0-flash"])
def test_round_trip_reproduces_cold_logits(tiny_model, flash_attn: bool, cache: str) -> None:
    llm = open_llama(tiny_model, flash_attn=flash_attn, type_k=cache, n_ctx=256, n_threads=THREADS, n_threads_batch=THREADS)
    check = check_restore(llm, context_cache(llm))
    assert check.ok, check.detail
    assert llm.n_tokens == 0


@pytest.mark.fp_path
@pytest.mark.parametrize("flash_attn,cache", [(False, "f16"), (True, "f16"), (True, "q8_0")], ids=["f16", "f16-flash", "q8_0-flash"])
def test_layouts_whose_kernels_ignore_batch_size_are_exact(tiny_model, flash_attn: bool, cache: str) -> None:
    """CPU-dependent by nature: it states that llama.cpp gives these layouts the same bits for any batch of 2+.

    f16 with flash attention only on kvpool's build (deploy/patches/flash-attn-rows.patch), which the suite runs on.
    """
    llm = open_llama(tiny_model, flash_attn=flash_attn, type_k=cache, n_ctx=256, n_threads=THREADS, n_threads_batch=THREADS)
    check = check_restore(llm, context_cache(llm))
    assert check.exact, check.detail


def test_a_rebuild_for_the_wrong_v_layout_fails_the_check(tiny_model) -> None:
    llm = open_llama(tiny_model, flash_attn=True, n_ctx=256, n_threads=THREADS, n_threads_batch=THREADS)
    wrong = replace(context_cache(llm), flash_attn=False)
    check = check_restore(llm, wrong)
    assert not check.ok and not check.exact and "StateRestoreError" in check.detail
