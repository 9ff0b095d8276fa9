"""The start-up check: does cut, rebuild and restore reproduce a cold evaluation on this model and layout?

A state blob carries no version, and llama.cpp loads a wrong assembly without a word.
So before it restores anything from the store, a worker proves the round trip on its
own model and context: evaluate a few chunks cold, cut the state, rebuild it, restore
it into the emptied sequence, evaluate the same suffix, and compare the logits.

The comparison also tells whether the layout is *exact*: a restored prefix plus a
short suffix gives the very bits of the cold evaluation. That holds where llama.cpp's
kernels do not depend on the batch's size (f16 with or without flash attention on
kvpool's build, q8_0 with it); stock llama.cpp's f16 flash attention picks its kernel by
the batch's size (``deploy/patches/flash-attn-rows.patch`` says how) and is close, not
exact. An inexact layout still restores, and says so in its metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import llama_cpp
import numpy as np

from worker.cache.checkpoints import WINDOW_ALIGN, restore_checkpoint
from worker.cache.kvchunks import cut_state, join_state
from worker.engine.kvcache import ContextCache
from worker.engine.llama_state import Llama, evaluate_prompt, last_logits, read_seq_state, restore_seq_state
from worker.settings import WorkerSettings
from worker.startup.checkrecords import CheckRecords

log = logging.getLogger("kvpool.worker")

CHECK_CHUNK = 16
CHECK_CHUNKS = 3
CHECK_SUFFIX = 5
ATOL = 0.05
CHECKPOINT_SUFFIX = 9
"""Tokens evaluated after the restored checkpoint in `check_checkpoint`."""


@dataclass(frozen=True)
class SelfCheck:
    ok: bool
    """Restores may be used: same argmax, logits within `ATOL`."""
    exact: bool
    """The restored run gave bit-identical logits."""
    detail: str


def check_restore(llm: Llama, kv: ContextCache, seed: int = 0) -> SelfCheck:
    """Runs the round trip. Leaves the context empty."""
    n_prefix = CHECK_CHUNK * CHECK_CHUNKS
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(3, llm.n_vocab(), n_prefix + CHECK_SUFFIX)]
    try:
        llm.reset()
        evaluate_prompt(llm, tokens, 0)
        cold = last_logits(llm)
        payloads = cut_state(read_seq_state(llm), CHECK_CHUNK, 0, CHECK_CHUNKS)
        llm.reset()
        restore_seq_state(llm, join_state(payloads, v_trans=kv.v_trans), tokens[:n_prefix])
        evaluate_prompt(llm, tokens, n_prefix)
        warm = last_logits(llm)
    except Exception as e:  # any failure here means: do not restore
        return SelfCheck(False, False, f"{type(e).__name__}: {e}")
    finally:
        llm.reset()
    diff = float(np.max(np.abs(cold - warm)))
    same_argmax = int(cold.argmax()) == int(warm.argmax())
    ok = same_argmax and diff <= ATOL and bool(np.isfinite(warm).all())
    exact = ok and bool(np.array_equal(cold, warm))
    detail = (
        f"max |logit diff| {diff:.3g} (tolerance {ATOL}), argmax {'same' if same_argmax else 'differs'}, {'exact' if exact else 'inexact'}"
    )
    return SelfCheck(ok, exact, detail)


@dataclass(frozen=True)
class Verdict:
    """What a worker may do with stored state, decided once at start-up."""

    restore: bool
    """Restore from the store and publish to it."""
    exact: bool
    """A restore gives the cold evaluation's bits."""
    checkpoints: bool = False
    """The state is stored whole at chunk boundaries (`worker.cache.checkpoints`), not cut into cells."""


def startup_verdict(llm: Llama, kv: ContextCache, settings: WorkerSettings, records: CheckRecords, *, store: bool, shared: bool) -> Verdict:
    """Run the start-up check that applies to this memory (cells or checkpoints), or take it from ``records``, and log its outcome.

    ``shared``: the context holds several sequences (`worker.engine.context`); checkpoints then stay off.
    """
    if kv.cuttable:
        if not settings.self_check:
            return Verdict(True, False)
        check, source = records.recall("restore-cells", SelfCheck, lambda: check_restore(llm, kv))
    elif not kv.checkpoints or not store or shared:
        why = kv.reason if not kv.checkpoints else "no store" if not store else "KVPOOL_PARALLEL > 1"
        log.warning("restore.disabled", extra={"reason": why})
        return Verdict(False, False)
    elif settings.self_check:
        check, source = records.recall("restore-checkpoint", SelfCheck, lambda: check_checkpoint(llm))
    else:
        return Verdict(True, False, checkpoints=True)
    level = logging.INFO if check.ok else logging.ERROR
    kind = "cells" if kv.cuttable else "checkpoint"
    extra = {"ok": check.ok, "exact": check.exact, "kind": kind, "detail": check.detail, "source": source}
    log.log(level, "restore.selfcheck", extra=extra)
    if check.ok and not kv.cuttable:
        log.info("restore.checkpoints", extra={"reason": kv.reason, "every": settings.checkpoint_every})
    return Verdict(check.ok, check.exact, checkpoints=check.ok and not kv.cuttable)


def check_checkpoint(llm: Llama, seed: int = 0) -> SelfCheck:
    """Prove on this model and CPU that a restored checkpoint plus a suffix gives the cold logits to the bit.

    The checkpoint lies past the sliding window (where there is one), so that the restored
    state holds only the window's cells, shifted by `WINDOW_ALIGN`. Leaves the context empty.
    """
    n_swa = max(0, int(llama_cpp.llama_model_n_swa(llm.model)))
    k = n_swa + WINDOW_ALIGN if n_swa else 48
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(3, llm.n_vocab(), k + CHECKPOINT_SUFFIX)]
    try:
        llm.reset()
        evaluate_prompt(llm, tokens, 0)
        cold = last_logits(llm)
        llm.reset()
        evaluate_prompt(llm, tokens[:k], 0)
        state = read_seq_state(llm)
        llm.reset()
        restore_checkpoint(llm, state, tokens[:k], n_swa)
        evaluate_prompt(llm, tokens, k)
        warm = last_logits(llm)
    except Exception as e:  # any failure here means: do not restore
        return SelfCheck(False, False, f"{type(e).__name__}: {e}")
    finally:
        llm.reset()
    exact = bool(np.array_equal(cold, warm))
    diff = float(np.max(np.abs(cold - warm)))
    return SelfCheck(exact, exact, f"checkpoint after {k} tokens ({len(state)} bytes), {CHECKPOINT_SUFFIX} more: max |diff| {diff:.3g}")
