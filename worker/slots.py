"""A worker's sequences: one context opened for ``KVPOOL_PARALLEL`` of them, and one engine per sequence.

With ``parallel`` = 1 the engine owns a plain ``llama_cpp.Llama``, as it always did.
With P > 1 the context holds P KV streams and the `worker.batcher.Batcher` decodes for
all of them; each sequence gets a `worker.sequence.SeqView` and an engine of its own
(`worker.engine.Engine.for_sequence`): what a job needs of its own (the cells its stream holds, their tenant,
the answer to publish) is per sequence; the model, the store, the publisher, the leases
and the start-up checks' verdicts are shared. The worker process runs one RQ worker per
sequence (`worker.process`), each with the name, queue and advert of its own, so routing
sends a request to the sequence whose cells hold its prefix.
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp

from worker.batcher import Batcher
from worker.llama_state import Llama, open_llama
from worker.sequence import SeqView
from worker.settings import WorkerSettings


def open_context(settings: WorkerSettings, model_path: Path) -> tuple[Llama, Batcher | None]:
    """The context the engine decodes with: a ``Llama``, or sequence 0 of a shared one and its batcher."""
    raw = open_llama(
        model_path,
        flash_attn=settings.flash_attn,
        type_k=settings.type_k,
        type_v=settings.type_v,
        n_ctx=settings.n_ctx,
        n_batch=settings.n_batch,
        n_threads=settings.n_threads,
        n_threads_batch=settings.threads_batch(),
        n_gpu_layers=settings.n_gpu_layers,
        n_seq=settings.parallel,
    )
    if settings.parallel == 1:
        return raw, None
    if llama_cpp.llama_model_is_recurrent(raw.model) or llama_cpp.llama_model_is_hybrid(raw.model):
        raw.close()
        raise ValueError("KVPOOL_PARALLEL > 1 needs a model whose cache keeps one cell per token (not recurrent or hybrid)")
    batcher = Batcher(
        raw, n_ubatch=int(raw.context_params.n_ubatch), prefill_chunk=settings.prefill_chunk, gather_s=settings.gather_ms / 1000
    )
    return SeqView(batcher, 0, settings.parallel, settings.n_ctx), batcher
