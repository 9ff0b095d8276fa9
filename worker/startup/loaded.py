"""A worker process's model, loaded once, and what every sequence's engine shares of it.

`LoadedModel` opens the `worker.engine.context.Context` (the model and the loop that owns its
llama.cpp context), reads the KV layout and kernels that decide the worker's bits, runs
the start-up checks (restore and decode mode) once, and holds the publisher, the
measured evaluation rate and what each sequence holds (`family`). Each sequence then gets
an engine of its own (`worker.answering.Engine`), built from this object and its sequence
number: its cells, its leases and its pending publishes are its own; nothing else is
copied from another engine.
"""

from __future__ import annotations

import logging
from pathlib import Path

from store.checkpoints import Checkpoints
from store.fingerprint import fingerprint_file
from store.store import Store
from worker import metrics
from worker.cache.held import Held
from worker.cache.leases import EvalRate
from worker.cache.namespace import SHARED_KERNELS, cache_format, kernels_field, worker_kernels
from worker.cache.publisher import Publisher
from worker.engine.context import Context
from worker.engine.decoding import DecodeMode, ModeChoice, choose_mode
from worker.engine.kvcache import CACHE_TYPE_NAMES, ContextCache, context_cache
from worker.settings import WorkerSettings
from worker.startup.checkrecords import CheckRecords, default_folder
from worker.startup.selfcheck import startup_verdict

log = logging.getLogger("kvpool.worker")


class LoadedModel:
    """The model, its context and the start-up verdicts, shared by the engines of its sequences."""

    def __init__(self, settings: WorkerSettings, model_path: Path, *, store: Store | None) -> None:
        self.settings = settings
        self.store = store
        self.fingerprint = fingerprint_file(model_path)
        self.context = Context(settings, model_path)
        probe = self.context.sequence(0)  # the start-up checks run here; sequence 0's engine starts from it emptied
        self.kv: ContextCache = context_cache(probe)
        self.kernels = worker_kernels(settings)
        self.layout = cache_format(
            CACHE_TYPE_NAMES.get(self.kv.type_k, str(self.kv.type_k)),
            CACHE_TYPE_NAMES.get(self.kv.type_v, str(self.kv.type_v)),
            self.kv.flash_attn,
            kernels_field(self.kernels, settings.share_across_kernels),
            checkpoints=self.kv.checkpoints,
        )
        self.labels = {"model": Path(model_path).name, "layout": self.layout.canonical()}
        if store is not None:  # what `kvpool store stats` says of the namespaces this worker publishes to
            store.about = {"kernels": SHARED_KERNELS if settings.share_across_kernels else self.kernels.canonical()}
        records = self._check_records()
        verdict = startup_verdict(probe, self.kv, settings, records, store=store is not None, shared=self.context.n_seq > 1)
        self.restore_enabled, self.exact = verdict.restore, verdict.exact
        self.checkpoints = Checkpoints(store) if verdict.checkpoints and store is not None else None
        """Set when this model's state is stored whole at chunk boundaries (`worker.cache.checkpoints`), not cut into cells."""
        if self.kv.prefix_reuse:
            choice, source = records.recall("decode-mode", ModeChoice, lambda: ModeChoice(*choose_mode(probe, settings.exact_decode)))
        else:
            choice, source = ModeChoice(DecodeMode.SETTLE, str(self.kv.reason)), "model"
        self.decode = choice.mode
        extra = {"mode": str(self.decode), "detail": choice.detail, "source": source}
        log.log(logging.INFO if self.decode.exact else logging.WARNING, "decode.mode", extra=extra)
        if self.context.n_seq > 1:  # whether a filler joins two sequences' steps in one pass over the weights (`worker.engine.rounds`)
            loop = self.context.loop
            loop.step_cost = loop.measure_steps(self.context.n_seq, 2 if self.decode is DecodeMode.PAIR else 1)
            log.info("loop.step_cost", extra={"ms": [round(c * 1000, 2) for c in loop.step_cost]})
        metrics.RESTORE_ENABLED.labels(**self.labels).set(int(self.restore_enabled))
        metrics.EXACT.labels(**self.labels).set(int(self.exact))
        self.publisher = Publisher(store, settings.publish_queue, self.labels) if store and settings.publish else None
        self.eval_rate = EvalRate()
        self.family: list[Held] = []
        """What each sequence of the context holds (each engine adds its own): `worker.cache.siblings` copies from them."""
        self.sequences: set[str] = set()
        """The names of the sequences of this context (each engine adds its own)."""

    def _check_records(self) -> CheckRecords:
        """Where the start-up checks' outcomes are remembered, for everything that decides them (`worker.startup.checkrecords`)."""
        s = self.settings
        folder = (s.check_records or default_folder()) if s.remember_checks else None
        params = self.context.llm.context_params
        return CheckRecords.for_worker(
            folder,
            model=self.fingerprint,
            layout=self.layout.canonical(),
            kernels=self.kernels.canonical(),
            n_ctx=s.n_ctx,
            n_seq=self.context.n_seq,
            n_batch=params.n_batch,
            n_ubatch=params.n_ubatch,
            n_threads=s.n_threads,
            n_threads_batch=s.threads_batch(),
            exact_decode=s.exact_decode,
        )

    def stop(self) -> None:
        """Stop the loop (every sequence's job still waiting on it fails), then the publisher; `Context.close` frees the rest."""
        self.context.loop.close()
        if self.publisher is not None:
            self.publisher.close()
