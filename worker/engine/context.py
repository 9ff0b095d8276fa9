"""A worker's context: the model loaded once, the engine loop that owns its llama.cpp context, and its sequences.

``KVPOOL_PARALLEL`` = P opens one context of P sequences, each in a KV stream of its
own (``n_seq_max`` = P, ``kv_unified`` off) holding ``KVPOOL_N_CTX`` cells, and one
`worker.engine.loop.EngineLoop`, the only thread that touches it. `Context.sequence` hands out
each sequence as a `worker.engine.sequence.SeqView`; each gets an engine of its own
(`worker.answering.Engine.for_sequence`) and an RQ worker of its own (`worker.process.main`), so
routing sends a request to the sequence whose cells hold its prefix. P = 1 is the same
code with one sequence.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp._internals as llama_internals

from worker.engine.kvcache import cache_type_id, is_quantized
from worker.engine.loop import EngineLoop
from worker.engine.sequence import SeqView
from worker.settings import WorkerSettings

AUTO_SEQUENCES = 4
"""``KVPOOL_PARALLEL`` = 0 gives a model whose cache keeps one cell per token this many sequences (llama-server's default slots)."""


@dataclass(frozen=True)
class CacheTraits:
    """What a model's header says of its cache, for the defaults chosen by model."""

    per_token: bool
    """The cache keeps one cell per token (not sliding-window, recurrent, hybrid, encoder or multi-dimensional positions)."""
    sliding: bool
    """Some layers attend over a sliding window: their cells live in a ring, so a restored state's cells sit elsewhere."""


@cache
def cache_traits(model_path: str) -> CacheTraits:
    """Read from the model's header alone (no weights loaded; a model loaded for its vocabulary has no hyperparameters, so the window is its header's key)."""
    vocab = llama_cpp.Llama(model_path, vocab_only=True, verbose=False)
    try:
        m, meta = vocab.model, vocab.metadata
        sliding = int(meta.get(f"{meta.get('general.architecture', '')}.attention.sliding_window", "0") or 0) > 0
        per_token = not (
            llama_cpp.llama_model_is_recurrent(m)
            or llama_cpp.llama_model_is_hybrid(m)
            or sliding
            or llama_cpp.llama_model_has_encoder(m)
            or llama_cpp.llama_model_rope_type(m)
            in (llama_cpp.LLAMA_ROPE_TYPE_MROPE, llama_cpp.LLAMA_ROPE_TYPE_IMROPE, llama_cpp.LLAMA_ROPE_TYPE_VISION)
        )
    finally:
        vocab.close()
    return CacheTraits(per_token=per_token, sliding=sliding)


def sequences_for(model_path: str | Path, parallel: int) -> int:
    """``KVPOOL_PARALLEL`` resolved for a model: as set, or for 0, `AUTO_SEQUENCES` where the cache keeps one cell per token, else 1.

    Sliding-window, recurrent and hybrid memories are stored as whole checkpoints, which
    need one sequence (`worker.cache.checkpoints`); encoder-decoder and multi-dimensional
    position models share nothing.
    """
    if parallel:
        return parallel
    return AUTO_SEQUENCES if cache_traits(str(model_path)).per_token else 1


def flash_attn_for(model_path: str | Path, flash_attn: bool | None) -> bool:
    """``KVPOOL_FLASH_ATTN`` resolved for a model: as set, or unset, on unless some layers attend over a sliding window.

    Flash attention sums a row's cells in tiles of 64 by where they sit in the cache
    (`deploy/patches/flash-attn-rows.patch`). Where every cell sits at its position, as in
    a cache of one cell per token restored in position order, that is the cold bits; a
    sliding window's ring puts a restored checkpoint's cells elsewhere than a cold
    evaluation did, and the answer after it differed from the cold one (a synthetic
    sliding-window model, `tests/worker/test_checkpoints.py`), so such models keep the two
    matrix products, which did not.
    """
    if flash_attn is not None:
        return flash_attn
    return not cache_traits(str(model_path)).sliding


class Context:
    """The model, the loop that owns its context, and the ``settings.parallel`` sequences it hands out (`sequences_for`)."""

    def __init__(self, settings: WorkerSettings, model_path: Path) -> None:
        self.n_seq, self.n_ctx = sequences_for(model_path, settings.parallel), settings.n_ctx
        self.llm = open_llama(
            model_path,
            flash_attn=flash_attn_for(model_path, settings.flash_attn),
            type_k=settings.type_k,
            type_v=settings.type_v,
            n_ctx=settings.n_ctx,
            n_batch=settings.n_batch,
            n_threads=settings.n_threads,
            n_threads_batch=settings.threads_batch(),
            n_gpu_layers=settings.n_gpu_layers,
            n_seq=self.n_seq,
        )
        if self.n_seq > 1 and (llama_cpp.llama_model_is_recurrent(self.llm.model) or llama_cpp.llama_model_is_hybrid(self.llm.model)):
            self.llm.close()
            raise ValueError("KVPOOL_PARALLEL > 1 needs a model whose cache keeps one cell per token (not recurrent or hybrid)")
        self.loop = EngineLoop(
            self.llm,
            n_ubatch=int(self.llm.context_params.n_ubatch),
            prefill_chunk=settings.prefill_chunk,
        )

    def sequence(self, seq: int) -> SeqView:
        """Sequence ``seq`` (0 ... P-1), as a context of its own."""
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence {seq} outside the context's {self.n_seq}")
        return SeqView(self.loop, seq, self.n_seq, self.n_ctx)

    def close(self) -> None:
        """Stop the loop (every job still waiting on it fails), then free the context and the model."""
        self.loop.close()
        self.llm.close()


def open_llama(
    model_path: str | Path,
    *,
    flash_attn: bool,
    type_k: str | int = "f16",
    type_v: str | int | None = None,
    n_ctx: int = 512,
    n_batch: int = 512,
    n_threads: int | None = None,
    verbose: bool = False,
    n_seq: int = 1,
    **kwargs: Any,
) -> llama_cpp.Llama:
    """A ``Llama`` with the given KV layout. ``type_v`` defaults to ``type_k``.

    llama-cpp-python 0.3.36 maps ``flash_attn`` to ``flash_attn_type`` ENABLED/DISABLED
    (never AUTO), so the V layout is fixed by this flag: off means V is stored transposed.
    With ``n_seq`` > 1 the context holds that many sequences of ``n_ctx`` cells each, each
    in a KV stream of its own (`worker.engine.context`).
    """
    k = cache_type_id(type_k)
    v = k if type_v is None else cache_type_id(type_v)
    if is_quantized(v) and not flash_attn:
        raise ValueError("a quantized V cache requires flash attention")
    llm = llama_cpp.Llama(
        model_path=str(model_path),
        n_ctx=n_ctx if n_seq == 1 else 64,
        n_batch=n_batch,
        n_threads=n_threads,
        flash_attn=flash_attn,
        type_k=k,
        type_v=v,
        verbose=verbose,
        **kwargs,
    )
    if n_seq > 1:
        open_streams(llm, n_seq, n_ctx, n_batch)
    return llm


def open_streams(llm: llama_cpp.Llama, n_seq: int, n_ctx: int, n_batch: int) -> None:
    """Replace the context ``Llama`` opened by one of ``n_seq`` streams of ``n_ctx`` cells (llama-cpp-python has no parameter for it)."""
    params = llm.context_params
    params.n_seq_max, params.kv_unified = n_seq, False
    params.n_ctx, params.n_batch, params.n_ubatch = n_ctx * n_seq, n_batch, n_batch
    llm._ctx.close()
    llm._ctx = llm._stack.enter_context(
        contextlib.closing(llama_internals.LlamaContext(model=llm._model, params=params, verbose=llm.verbose))
    )
    llm.n_batch = n_batch
