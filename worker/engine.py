"""The engine: one loaded model that answers jobs, never evaluating a prefix the pool already holds.

Order of work for a job (`Engine.run`):

1. Recompute the chain from the job's tokens; refuse the job if its keys disagree.
2. Reuse what this worker's own context already holds (longest common prefix, same
   tenant only: a hit across tenants would leak prompts through timing).
3. If the store holds a deeper prefix, fetch the missing chunks in parallel, verify
   them, join them with the chunks cut from the local context, and restore.
4. Evaluate the rest (always at least the last prompt token, so there are logits) and
   generate, streaming each token out.
5. Once the first token is out, hand the prompt's full chunks the store lacks to the
   background publisher; after the last token, the chunks that cover prompt plus
   completion (so the next turn of a chat, which resends the whole history, is a hit
   for any worker).

The store never fails a job: an unreachable store means a cold evaluation, a bad blob
ends the usable prefix where it starts, and publish errors are logged and counted.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np

from store.chain import Namespace
from store.errors import StoreError, StoreUnavailable
from store.fingerprint import fingerprint_file
from store.store import Store
from worker import metrics
from worker.kvchunks import StateFormatError, cut_state, join_state
from worker.llama_state import (
    CACHE_TYPE_NAMES,
    KvLayout,
    StateRestoreError,
    kv_layout,
    open_llama,
    read_seq_state,
    restore_seq_state,
)
from worker.protocol import JobRejected, JobResult, JobSpec, TokenEvent, Timings, Usage
from worker.namespace import chain_layout
from worker.publisher import Publisher
from worker.settings import WorkerSettings
from worker.textstream import TextStream

log = logging.getLogger("kvpool.worker")

Emit = Callable[[TokenEvent], bool]
"""Sends one token event; returns False when the job was cancelled."""


@dataclass
class _Plan:
    cached_context: int = 0
    cached_store: int = 0
    store_depth: int = 0
    store_status: str = "ok"
    timings: dict[str, float] = field(default_factory=dict)


class Engine:
    def __init__(self, settings: WorkerSettings, model_path: Path, *, store: Store | None, name: str) -> None:
        self.settings = settings
        self.name = name
        self.store = store
        self.model_path = model_path
        self.fingerprint = fingerprint_file(model_path)
        self.llm = open_llama(
            model_path,
            flash_attn=settings.flash_attn,
            type_k=settings.type_k,
            type_v=settings.type_v,
            n_ctx=settings.n_ctx,
            n_batch=settings.n_batch,
            n_threads=settings.n_threads,
            n_gpu_layers=settings.n_gpu_layers,
        )
        self.kv: KvLayout = kv_layout(self.llm)
        self.layout = chain_layout(
            CACHE_TYPE_NAMES.get(self.kv.type_k, str(self.kv.type_k)),
            CACHE_TYPE_NAMES.get(self.kv.type_v, str(self.kv.type_v)),
            self.kv.flash_attn,
        )
        self.labels = {"model": Path(model_path).name, "layout": self.layout.canonical()}
        self.context_tenant: str | None = None
        self.restore_enabled = False
        if not self.kv.cuttable:
            log.warning("restore.disabled", extra={"reason": self.kv.reason, "model": self.labels["model"]})
        elif settings.self_check:
            from worker.selfcheck import check_restore

            ok, detail = check_restore(self.llm, self.kv)
            self.restore_enabled = ok
            level = logging.INFO if ok else logging.ERROR
            log.log(level, "restore.selfcheck", extra={"ok": ok, "detail": detail})
        else:
            self.restore_enabled = True
        metrics.RESTORE_ENABLED.labels(**self.labels).set(int(self.restore_enabled))
        metrics.INFO.info({**self.labels, "restore": str(self.restore_enabled).lower(), "worker": name})
        self.publisher = Publisher(store, settings.publish_queue, self.labels) if store and settings.publish else None

    def namespace(self, tenant_salt: str) -> Namespace:
        return Namespace(self.fingerprint, self.layout, self.settings.chunk_size, tenant_salt)

    def held_keys(self) -> list[bytes]:
        """Chain keys of the full chunks in the context, under the tenant that filled it."""
        if self.context_tenant is None or self.llm.n_tokens == 0:
            return []
        return self.namespace(self.context_tenant).chain(self.llm.input_ids[: self.llm.n_tokens])

    def forget_context(self) -> None:
        """After a failed job the context's contents are unknown: start the next one from scratch."""
        self.context_tenant = None
        self.llm.reset()

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.llm.close()

    # -- a job -------------------------------------------------------------------

    def run(self, spec: JobSpec, emit: Emit) -> JobResult:
        t_start = time.perf_counter()
        self._validate(spec)
        ns = self.namespace(spec.tenant_salt)
        tokens = list(spec.tokens)
        keys = ns.chain(tokens)
        if [k.hex() for k in keys] != spec.chain:
            raise JobRejected("chain keys disagree with the tokens (different model, chunk size or tenant salt?)")

        plan = self._prepare(ns, tokens, keys)
        metrics.PROMPT_TOKENS.labels(**self.labels).inc(len(tokens))
        metrics.REUSED_TOKENS.labels(**self.labels).inc(plan.cached_context)
        metrics.RESTORED_TOKENS.labels(**self.labels).inc(plan.cached_store)
        cached = plan.cached_context + plan.cached_store
        evaluated = len(tokens) - cached
        metrics.EVALUATED_TOKENS.labels(**self.labels).inc(evaluated)

        s = spec.sampling
        self.llm.set_seed(s.seed if s.seed is not None else random.randrange(2**32))
        self.llm._requires_eval = True  # always decode at least the last prompt token: fresh logits
        stream = TextStream(self.llm, s.stop)
        generated: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        t_eval = time.perf_counter()
        t_first = None
        budget = min(s.max_tokens, self.settings.n_ctx - len(tokens))
        gen = self.llm.generate(
            tokens,
            top_k=s.top_k,
            top_p=s.top_p,
            min_p=s.min_p,
            temp=s.temperature,
            repeat_penalty=s.repeat_penalty,
            logits_processor=_bias(s.logit_bias) if s.logit_bias else None,
            reset=True,
        )
        try:
            for tok in gen if budget > 0 else ():
                first = t_first is None
                if first:
                    t_first = time.perf_counter()
                if llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, tok):
                    finish = "stop"
                    break
                generated.append(tok)
                lp, top = self._logprobs(tok, s.logprobs) if s.logprobs is not None else (None, None)
                if lp is not None:
                    logprobs.append(lp)
                text = stream.push(tok)
                piece = self.llm.detokenize([tok]).decode("utf-8", "replace") if lp is not None else None
                if not emit(TokenEvent(text=text, token=tok, piece=piece, logprob=lp, top_logprobs=top)):
                    finish = "cancelled"
                    break
                if first and plan.store_depth < len(tokens) // ns.chunk_size:
                    self._publish(ns, tokens)  # after the first token is out: the snapshot takes tens of ms
                if stream.stopped:
                    finish = "stop"
                    break
                if len(generated) >= budget:
                    break
        finally:
            gen.close()
        if finish != "cancelled" and not stream.stopped:
            tail = stream.flush()
            if tail:
                emit(TokenEvent(text=tail, token=-1))
        if t_first is None:
            t_first = time.perf_counter()
        t_end = time.perf_counter()
        self.context_tenant = spec.tenant_salt
        self._publish(ns, (tokens + generated)[: self.llm.n_tokens])
        if spec.wait_for_publish and self.publisher is not None:
            self.publisher.wait_idle()

        metrics.GENERATED_TOKENS.labels(**self.labels).inc(len(generated))
        metrics.FIRST_TOKEN_SECONDS.labels(**self.labels).observe(t_first - t_start)
        if generated and t_end > t_first:
            metrics.TOKENS_PER_SECOND.labels(**self.labels).observe(len(generated) / (t_end - t_first))
        return JobResult(
            text=stream.text,
            finish_reason=finish,  # type: ignore[arg-type]
            tokens=generated,
            usage=Usage(
                prompt_tokens=len(tokens),
                completion_tokens=len(generated),
                cached_tokens=cached,
                cached_from_context=plan.cached_context,
                cached_from_store=plan.cached_store,
                evaluated_tokens=evaluated,
            ),
            timings=Timings(
                queue_wait_s=max(0.0, time.time() - spec.enqueued_at - (t_end - t_start)),
                lookup_s=plan.timings.get("lookup", 0.0),
                fetch_s=plan.timings.get("fetch", 0.0),
                restore_s=plan.timings.get("restore", 0.0),
                prompt_eval_s=t_first - t_eval,
                first_token_s=t_first - t_start,
                total_s=t_end - t_start,
            ),
            worker=self.name,
            store_status=plan.store_status,  # type: ignore[arg-type]
            logprobs=logprobs if s.logprobs is not None else None,
        )

    def _validate(self, spec: JobSpec) -> None:
        if spec.model != self.fingerprint:
            raise JobRejected(f"job is for model {spec.model}, this worker serves {self.fingerprint}")
        if spec.chunk_size != self.settings.chunk_size:
            raise JobRejected(f"job uses chunk size {spec.chunk_size}, this worker {self.settings.chunk_size}")
        if len(spec.tokens) >= self.settings.n_ctx:
            raise JobRejected(f"prompt of {len(spec.tokens)} tokens does not fit the context of {self.settings.n_ctx}")
        n_vocab = self.llm.n_vocab()
        if any(t < 0 or t >= n_vocab for t in [*spec.tokens, *spec.sampling.logit_bias]):
            raise JobRejected(f"token ids must lie in [0, {n_vocab})")

    def _prepare(self, ns: Namespace, tokens: list[int], keys: list[bytes]) -> _Plan:
        """Bring the context to the deepest prefix available, locally or from the store."""
        plan = _Plan(store_status="ok" if self.store else "disabled")
        n_local = 0
        if self.context_tenant == ns.tenant_salt and self.llm.n_tokens > 0 and self.kv.prefix_reuse:
            held = self.llm.input_ids[: self.llm.n_tokens]
            upto = min(len(held), len(tokens))
            diff = np.flatnonzero(held[:upto] != np.asarray(tokens[:upto]))
            n_local = int(diff[0]) if diff.size else upto
        else:
            self.llm.reset()
        c = ns.chunk_size
        plan.cached_context = min(n_local, len(tokens) - 1)
        if self.store is None or not keys:
            return plan
        if not self.restore_enabled:
            metrics.COLD_FALLBACKS.labels(**self.labels, reason="restore_disabled").inc()
            return plan

        t0 = time.perf_counter()
        try:
            depth = self.store.lookup(ns, keys)
        except StoreUnavailable as e:
            plan.store_status = "unavailable"
            metrics.COLD_FALLBACKS.labels(**self.labels, reason="store_unavailable").inc()
            log.warning("store.unavailable", extra={"endpoint": e.endpoint, "reason": e.reason})
            return plan
        plan.timings["lookup"] = time.perf_counter() - t0
        plan.store_depth = depth
        if depth * c <= n_local:
            return plan

        local_chunks = n_local // c
        t1 = time.perf_counter()
        try:
            remote = self.store.fetch(ns, tokens, keys, local_chunks, depth)
        except StoreError as e:
            plan.store_status = "unavailable"
            log.warning("store.fetch_failed", extra={"reason": str(e)})
            remote = []
        plan.timings["fetch"] = time.perf_counter() - t1
        n_restore = (local_chunks + len(remote)) * c
        if n_restore <= n_local:
            return plan

        t2 = time.perf_counter()
        try:
            local = cut_state(read_seq_state(self.llm), c, 0, local_chunks) if local_chunks else []
            state = join_state([*local, *remote], v_trans=self.kv.v_trans)
            restore_seq_state(self.llm, state, tokens[:n_restore])
        except (StateRestoreError, StateFormatError) as e:
            metrics.COLD_FALLBACKS.labels(**self.labels, reason="restore_failed").inc()
            log.error("restore.failed", extra={"reason": str(e), "chunks": local_chunks + len(remote)})
            self.llm.reset()
            plan.cached_context = 0
            return plan
        plan.timings["restore"] = time.perf_counter() - t2
        metrics.RESTORE_SECONDS.labels(**self.labels).observe(time.perf_counter() - t1)
        metrics.RESTORE_BYTES.labels(**self.labels).inc(sum(len(p) for p in remote))
        plan.cached_context = min(local_chunks * c, len(tokens) - 1)
        plan.cached_store = min(n_restore, len(tokens) - 1) - plan.cached_context
        return plan

    # -- publishing -------------------------------------------------------------

    def _publish(self, ns: Namespace, held: list[int]) -> None:
        """Hand the context's state to the background publisher; it stores the full chunks the store lacks.

        ``held`` are the tokens whose cells the context holds: the prompt just after the
        first token, prompt plus completion (less the last, never evaluated) at the end.
        """
        if self.publisher is None or not self.restore_enabled or len(held) < ns.chunk_size:
            return
        self.publisher.submit(ns, held, read_seq_state(self.llm))

    def _logprobs(self, tok: int, top_n: int) -> tuple[float, dict[str, float] | None]:
        n_vocab = self.llm.n_vocab()
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(n_vocab,)).astype(np.float64)
        m = logits.max()
        logz = m + np.log(np.exp(logits - m).sum())
        lp = float(logits[tok] - logz)
        if not top_n:
            return lp, None
        best = np.argpartition(-logits, top_n)[:top_n]
        top = {self.llm.detokenize([int(i)]).decode("utf-8", "replace"): float(logits[i] - logz) for i in best}
        return lp, top



def _bias(bias: dict[int, float]) -> llama_cpp.LogitsProcessorList:
    ids = np.fromiter(bias.keys(), dtype=np.int64)
    values = np.fromiter(bias.values(), dtype=np.float32)

    def apply(_input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        scores[ids] += values
        return scores

    return llama_cpp.LogitsProcessorList([apply])
