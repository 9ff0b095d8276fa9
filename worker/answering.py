"""The engine: one loaded model that answers jobs, never evaluating a prefix the pool already holds.

Order of work for a job (`Engine.run`):

1. Recompute the chain from the job's tokens; refuse the job if its keys disagree.
2. Reuse what this worker's own context already holds (longest common prefix, same
   tenant only: a hit across tenants would leak prompts through timing).
3. If the store holds a deeper prefix, fetch the missing chunks in parallel, verify
   them, join them with the chunks cut from the local context, and restore (a memory
   that cannot be cut restores its deepest whole-state checkpoint: `worker.cache.checkpoints`).
4. Evaluate the rest, always at least the last two prompt tokens and never a one-token
   last batch (`worker.engine.llama_state.batch_sizes`), then generate, streaming each token out
   and decoding it exactly where the build allows (`worker.engine.decoding`).
5. Once the first token is out, hand the prompt's full chunks the store lacks to the
   background publisher; once the answer is out (`Engine.after_answer`), publish prompt
   plus answer, whose cells are then a cold evaluation's: the next turn of a chat, which
   resends the whole history, resumes after the answer on any worker. Where decoding is
   not exact, the completion is evaluated again as prompt once the worker idles
   (`Engine.settle`) and published then.

The answer does not depend on what was reused. For a given prompt, model and KV layout,
the first sampled token's logits are the same bits whether the prefix came from this
context, from the store or from a cold evaluation, and whatever the prompt's length:
llama.cpp's CPU kernels give the same bits for any split into batches of two or more
tokens. The start-up self-check reports whether a layout keeps this promise (stock
llama.cpp's f16 flash attention picks its kernel by batch size, and does not), and
`worker.engine.decoding.choose_mode` whether generated tokens can be decoded exactly.

The store never fails a job: an unreachable store means a cold evaluation, a bad blob
ends the usable prefix where it starts, and publish errors are logged and counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from store.chain import BlobKey, Namespace, PrefixKey, prefix_chain
from store.store import Store
from worker import metrics
from worker.cache.checkpoints import checkpoint_stops, evaluate_saving
from worker.cache.held import Held
from worker.cache.leases import Leases
from worker.cache.prefix import Plan, PrefixFinder
from worker.engine.decoding import answer_held, settle, step_tokens
from worker.engine.kvstate import Buffer
from worker.engine.llama_state import evaluate_prompt, read_seq_state, readable_from
from worker.engine.sampling import Output, job_result, sample_choices
from worker.engine.scoring import score_prompt
from worker.engine.sequence import SeqView
from worker.errors import JobRejected
from worker.protocol import Breakpoint, JobResult, JobSpec, Timings, TokenEvent, Usage
from worker.settings import WorkerSettings
from worker.startup.loaded import LoadedModel

log = logging.getLogger("kvpool.worker")

Emit = Callable[[TokenEvent], bool]
"""Sends one token event; returns False when the job was cancelled."""


class Engine:
    """The engine of sequence ``seq`` of a loaded model's context (`worker.startup.loaded.LoadedModel`).

    The model, its layout and verdicts, the publisher and the evaluation rate are the
    loaded model's, shared by its sequences' engines; the sequence's cells (`Held`), its
    leases and its pending publishes are this engine's own.
    """

    def __init__(self, loaded: LoadedModel, seq: int, name: str) -> None:
        self.loaded, self.name = loaded, name
        self.settings, self.store, self.fingerprint = loaded.settings, loaded.store, loaded.fingerprint
        self.kv, self.kernels, self.layout, self.labels = loaded.kv, loaded.kernels, loaded.layout, loaded.labels
        self.restore_enabled, self.exact, self.checkpoints = loaded.restore_enabled, loaded.exact, loaded.checkpoints
        self.decode, self.publisher, self.eval_rate = loaded.decode, loaded.publisher, loaded.eval_rate
        self.family, self.sequences = loaded.family, loaded.sequences
        self.owner = seq == 0
        """This engine stops the loop and frees the context at `close` (sequence 0's; the others share them)."""
        self.held = Held(loaded.context.sequence(seq), self.kv)
        self.family.append(self.held)
        self.sequences.add(name)
        self._pending: tuple[Namespace, list[int], list[BlobKey], list[int]] | None = None
        """The last job's prompt, its keys and its answer, until the answer is published."""
        self._deferred: tuple[Namespace, list[int], list[BlobKey], int] | None = None
        store, settings = self.store, self.settings
        self.leases = (  # a lease names the sequence holding it
            Leases(store.index.r, name, settings.lease_s, settings.lease_wait_min_s)
            if store is not None and self.publisher and settings.coalesce
            else None
        )
        self.finder = self._finder()
        self.forget_context()
        if self.owner:
            metrics.INFO.info({**self.labels, **self.identity(), "restore": str(self.restore_enabled).lower(), "worker": name})

    @classmethod
    def open(cls, settings: WorkerSettings, model_path: Path, *, store: Store | None, name: str) -> Engine:
        """Load the model (its context of ``settings.parallel`` sequences, the start-up checks) and return sequence 0's engine."""
        return cls(LoadedModel(settings, model_path, store=store), 0, name)

    def _finder(self) -> PrefixFinder:
        return PrefixFinder(
            self.held,
            self.store,
            self.checkpoints,
            self.leases,
            self.eval_rate,
            self.labels,
            self.restore_enabled,
            self.name,
            self.sequences,
            self.family,
        )

    @property
    def llm(self) -> SeqView:
        """This engine's sequence of the worker's context."""
        return self.held.llm  # type: ignore[return-value]

    @property
    def publishes_cells(self) -> bool:
        """Prompt cells go to the store chunk by chunk (a cuttable cache whose restores passed the check)."""
        return self.restore_enabled and self.kv.cuttable

    def identity(self) -> dict[str, str]:
        """What decides this worker's bits, for /readyz and ``kvpool_worker_info``."""
        return {
            "kernels": self.kernels.canonical(),
            "share_across_kernels": str(self.settings.share_across_kernels).lower(),
            "decode": str(self.decode),
        }

    def namespace(self, tenant_salt: str) -> Namespace:
        """Where this worker's blobs live: the chain rooted in its KV layout."""
        return Namespace(self.fingerprint, self.layout, self.settings.chunk_size, tenant_salt)

    def held_keys(self) -> list[PrefixKey]:
        """Prefix keys of the full chunks the context holds exactly, under the tenant that filled it (what adverts list)."""
        return self.held.prefix_keys(self.fingerprint, self.settings.chunk_size)

    def forget_context(self) -> None:
        """Start the next job from an empty context (after a failure its contents are unknown)."""
        self.held.forget()

    def for_sequence(self, seq: int, name: str) -> Engine:
        """The engine of another sequence of this engine's context (`worker.engine.context`)."""
        return Engine(self.loaded, seq, name)

    def close(self) -> None:
        """Sequence 0's engine stops the loop and the publisher, and frees the context; every engine closes its leases."""
        if self.owner:
            self.loaded.stop()
        if self.leases is not None:
            self.leases.close()
        if self.owner:
            self.loaded.context.close()

    # -- a job -------------------------------------------------------------------

    def run(self, spec: JobSpec, emit: Emit) -> JobResult:
        t_start = time.perf_counter()
        self._deferred = None
        if (misfit := spec.misfit(self.fingerprint, self.settings.chunk_size, self.settings.n_ctx, self.llm.n_vocab())) is not None:
            raise JobRejected(misfit)
        ns = self.namespace(spec.tenant_salt)
        tokens = list(spec.tokens)
        prefix = prefix_chain(self.fingerprint, self.settings.chunk_size, spec.tenant_salt, tokens)
        if [k.hex() for k in prefix] != spec.chain:
            raise JobRejected("the job's prefix keys disagree with its tokens (different model, chunk size or tenant salt?)")
        self.held.learn(spec.tenant_salt, tokens, prefix)
        keys = ns.chain(tokens)  # the blob chain, hashed once and passed along

        plan = self._plan_for(spec, ns, tokens, keys)
        try:
            self._count_prompt(plan, len(tokens))
            t_eval = time.perf_counter()
            scored = self._evaluate(spec, ns, tokens, keys, plan.start)
            self.eval_rate.observe(len(tokens) - plan.start, time.perf_counter() - t_eval)
            self.held.hold(spec.tenant_salt, len(tokens))
            outs = self._generate(spec, emit, lambda: self._publish_or_defer(spec, ns, tokens, keys, plan))
            out = outs[0]
            if self.decode.exact:  # the context holds the last choice's cells, each what a cold evaluation holds
                self.held.exact_upto = self.llm.n_tokens
            self._publish(ns, tokens, keys, plan, spec.breakpoints)
        finally:
            self.finder.handoff(plan)()
        if spec.wait_for_publish and self.publisher is not None:
            self.publisher.wait_idle()
        last = outs[-1] if self.decode.exact else out
        self._pending = (ns, tokens, keys, last.tokens) if last.finish != "cancelled" else None
        t_first = out.t_first or time.perf_counter()
        t_end = time.perf_counter()
        n_generated = sum(len(o.tokens) for o in outs)
        metrics.GENERATED_TOKENS.labels(**self.labels).inc(n_generated)
        metrics.FIRST_TOKEN_SECONDS.labels(**self.labels).observe(t_first - t_start)
        if n_generated and t_end > t_first:
            metrics.TOKENS_PER_SECOND.labels(**self.labels).observe(n_generated / (t_end - t_first))
        timings = Timings(
            queue_wait_s=max(0.0, time.time() - spec.enqueued_at - (t_end - t_start)),
            lookup_s=plan.timings.get("lookup", 0.0),
            fetch_s=plan.timings.get("fetch", 0.0),
            restore_s=plan.timings.get("restore", 0.0),
            lease_wait_s=plan.timings.get("lease_wait", 0.0),
            prompt_eval_s=t_first - t_eval,
            first_token_s=t_first - t_start,
            total_s=t_end - t_start,
        )
        return self._result(spec, plan, outs, timings, scored)

    def _plan_for(self, spec: JobSpec, ns: Namespace, tokens: list[int], keys: list[BlobKey]) -> Plan:
        """The prefix to keep; none for a scored prompt, whose every position needs its logits (`worker.engine.scoring`)."""
        if spec.sampling.prompt_logprobs is None:
            return self.finder.find(ns, tokens, keys)
        plan = Plan(store_status="ok" if self.store else "disabled")
        self.finder.store_hit(ns, tokens, keys, plan)
        return plan

    def _evaluate(self, spec: JobSpec, ns: Namespace, tokens: list[int], keys: list[BlobKey], start: int) -> list[TokenEvent] | None:
        if spec.sampling.prompt_logprobs is not None:
            return score_prompt(self.llm, tokens, spec.sampling.prompt_logprobs)
        if self.checkpoints is None or self.publisher is None:
            evaluate_prompt(self.llm, tokens, start)
            return None
        stops = checkpoint_stops(start, len(tokens), ns.chunk_size, self.settings.checkpoint_every, self.kv.n_swa, spec.message_starts)
        states = evaluate_saving(self.llm, tokens, start, self.checkpoints.missing(ns, tokens, keys, stops))
        if states:
            self.publisher.submit_checkpoints(ns, tokens, keys, states, resumed=start)
        return None

    def _count_prompt(self, plan: Plan, n_prompt: int) -> None:
        metrics.PROMPT_TOKENS.labels(**self.labels).inc(n_prompt)
        metrics.REUSED_TOKENS.labels(**self.labels).inc(plan.cached_context)
        metrics.RESTORED_TOKENS.labels(**self.labels).inc(plan.cached_store)
        metrics.EVALUATED_TOKENS.labels(**self.labels).inc(n_prompt - plan.start)

    def _generate(self, spec: JobSpec, emit: Emit, after_first: Callable[[], None]) -> list[Output]:
        """Sample the job's choices from the evaluated prompt, streaming each token; ``after_first`` runs once the first is out."""
        return sample_choices(self.llm, spec, emit, after_first, self.settings.n_ctx, lambda: self._rewind(spec.tokens), self._steps)

    def _steps(self, token: int, next_token: Callable[[], int | None]) -> None:
        """Decode ``token`` and each token ``next_token`` samples after it, every step on the engine loop's thread."""
        llm, mode = self.llm, self.decode

        def next_step() -> tuple[list[int], int] | None:
            tok = next_token()
            return None if tok is None else step_tokens(llm, tok, mode)

        llm.generate(*step_tokens(llm, token, mode), next_step)

    def _rewind(self, tokens: list[int]) -> None:
        """Back to the end of the prompt for another choice: its last two tokens evaluated again, as one batch."""
        if not self.kv.prefix_reuse:
            self.llm.reset()
        evaluate_prompt(self.llm, tokens, max(0, len(tokens) - 2) if self.kv.prefix_reuse else 0)

    def _result(self, spec: JobSpec, plan: Plan, outs: list[Output], timings: Timings, scored: list[TokenEvent] | None) -> JobResult:
        n = len(spec.tokens)
        usage = Usage(
            prompt_tokens=n,
            completion_tokens=sum(len(o.tokens) for o in outs),
            cached_tokens=plan.start,
            cached_from_context=plan.cached_context,
            cached_from_store=plan.cached_store,
            evaluated_tokens=n - plan.start,
        )
        return job_result(spec, outs, usage, timings, scored, worker=self.name, store_status=plan.store_status, restore_choice=plan.choice)

    def settle(self, job_waiting: Callable[[], bool]) -> None:
        """Without exact decoding: once the answer is out and the worker idles, evaluate the completion as prompt
        (`worker.engine.decoding.settle`) and publish prompt plus completion."""
        pending, self._pending = self._pending, None
        if pending is None or self.decode.exact or not self.settings.settle_completions or not self.kv.prefix_reuse:
            return
        ns, tokens, keys, generated = pending
        try:
            for pos in settle(
                self.llm, tokens, generated, n_ctx=self.settings.n_ctx, idle_s=self.settings.settle_idle_s, job_waiting=job_waiting
            ):
                self.held.exact_upto = pos
        except Exception:  # the answer is already out: never fail the job for this
            log.exception("settle.failed")
            self.forget_context()
            return
        if self.held.exact_upto == len(tokens) + len(generated):
            self._publish(ns, tokens + generated, ns.extend(keys, tokens + generated), Plan())

    # -- publishing -------------------------------------------------------------

    def _publish(self, ns: Namespace, tokens: list[int], keys: list[BlobKey], plan: Plan, breakpoints: Sequence[Breakpoint] = ()) -> None:
        """Hand the prompt's state to the background publisher, once a job; it stores what the store lacks.

        That is the full chunks and the partial last one (the tail), so that any worker can
        resume at this prompt's last token, and the prefix up to each breakpoint, which it
        then pins. Called just after the first token is out when the store lacks a full chunk
        or the job has breakpoints (`_publish_or_defer`), or at the end when no token came
        (an answer cut short still publishes). Only the prompt: the answer follows in
        `after_answer` (exact decoding) or `settle`.
        """
        if plan.published or self.publisher is None or not self.publishes_cells:
            return
        plan.published = True
        release = self.finder.handoff(plan)
        snap = None
        if plan.store_tokens < len(tokens) or self.publisher.lacks(ns, tokens, keys, breakpoints):
            c = ns.chunk_size  # the store held the chunks before the first it lacked when the job looked, and pins need their tails
            snap = self._snapshot(min([plan.store_tokens // c * c, *(b.tokens // c * c for b in breakpoints)]))
            if snap is None:
                return release()
        if snap is None and not breakpoints:
            return release()
        state, first = snap if snap is not None else (None, 0)
        self.publisher.submit(ns, tokens, keys, state, on_done=release, breakpoints=breakpoints, recycle=state is not None, first=first)

    def _publish_or_defer(self, spec: JobSpec, ns: Namespace, tokens: list[int], keys: list[BlobKey], plan: Plan) -> None:
        """At the first token: publish now if the store lacks a full chunk, else leave the tail for `after_answer`.

        New full chunks go out at once: other workers may be waiting for them (`worker.cache.leases`).
        A tail alone serves only a later resend or turn of this prompt, so copying the whole
        sequence state for it (about 40 ms for 2,000 tokens of a small model) waits until the
        answer is out. A batch leader's siblings wait for its publish, and a job with
        breakpoints asked for its prefix to be kept whatever becomes of the answer: neither defers.
        """
        full = len(tokens) // ns.chunk_size * ns.chunk_size
        if spec.wait_for_publish or spec.breakpoints or plan.store_tokens < full or plan.published or not self.publishes_cells:
            return self._publish(ns, tokens, keys, plan, spec.breakpoints)
        plan.published = True
        self.finder.handoff(plan)()
        if self.publisher is not None and plan.store_tokens < len(tokens):
            self._deferred = (ns, tokens, keys, full)

    def after_answer(self) -> None:
        """Once the job's last event is out: publish what the next request may resume from.

        With exact decoding that is prompt plus answer as the context holds them
        (`worker.engine.decoding.answer_held`: all but the answer's last token, never decoded): the
        next turn of a chat resumes there on any worker. Otherwise it is the prompt's tail that
        `_publish_or_defer` left; the context still holds the prompt's cells (generation only
        appends after them), and only the prompt's cells are cut from the copy.
        """
        deferred, self._deferred = self._deferred, None
        if self.decode.exact and self._pending is not None:
            (ns, tokens, keys, generated), self._pending = self._pending, None
            held = answer_held(self.llm, tokens, generated)
            if held is not None:  # the prompt's full chunks went out with its first token, or the store held them
                deferred = (ns, held, ns.extend(keys, held), len(tokens) // ns.chunk_size * ns.chunk_size) if self.publishes_cells else None
        if deferred is None or self.publisher is None:
            return
        ns, tokens, keys, start = deferred
        if (snap := self._snapshot(start)) is not None:
            self.publisher.submit(ns, tokens, keys, snap[0], recycle=True, first=snap[1])

    def _snapshot(self, start: int) -> tuple[Buffer, int] | None:
        """A copy of the sequence's cells for publishing, into one of the publisher's buffers, and the position it begins at;
        None on failure: publishing never fails a job.

        It begins at ``start`` (the first chunk to publish) with kvpool's build of llama.cpp, else
        at 0 (`worker.engine.llama_state.readable_from`): the cells the store holds are not copied again.
        """
        first = readable_from(start)
        try:
            return read_seq_state(self.llm, into=self.publisher.buffer if self.publisher else None, start=first), first
        except Exception as e:
            metrics.PUBLISH_ERRORS.labels(**self.labels, reason=type(e).__name__).inc()
            log.warning("publish.snapshot_failed", extra={"reason": str(e)})
            return None
