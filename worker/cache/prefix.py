"""Bringing a sequence's context to the deepest prefix of a prompt that is available: its own cells, then the store.

`Held` is what one sequence's context holds: the tenant that filled it and how many of
its leading cells are exact (same tenant, cells from prompt batches or exact decoding),
with the prefix keys of those cells, learned from the jobs that filled them rather than
hashed again for every advert. `PrefixFinder`, one per sequence beside the engine,
decides how many prompt cells a job keeps. The context counts only where its cells are
exact; the store counts when it holds more of the prompt than that: full chunks, then
the stored tail that matches the prompt furthest (`store.tails`), so a worker resumes at
the exact token another one reached. What the store adds is fetched, verified, joined
with the local chunks and restored in one go. The last two prompt tokens are never kept
(`keepable`).

When another worker is evaluating chunks of the same prompt right now, `coalesce`
waits for it to publish them rather than evaluating them too (`worker.cache.leases`), then
finds the prefix again; it leases the chunks it will evaluate itself. `find` does all
of it for a job: whether to restore what the store holds is decided after each lookup
(`worker.cache.restore_choice`), but only the last decision is acted on, so a job restores
once and reports one decision (log `restore.choice`, the metric, its `job.done` line).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import redis

from store.chain import BlobKey, Namespace
from store.checkpoints import Checkpoints
from store.errors import StoreError, StoreUnavailable
from store.store import Fetched, Store
from store.tails import Hit
from worker import metrics
from worker.cache.checkpoints import restore_checkpoint
from worker.cache.held import Held
from worker.cache.kvchunks import cut_state, head_cells, join_state
from worker.cache.leases import Claim, EvalRate, LeaseOutcome, Leases, leased_by_others
from worker.cache.restore_choice import Choice, Decision, Option, RestoreRate, choose
from worker.cache.siblings import copy_from_sibling
from worker.engine.kvcache import ContextCache
from worker.engine.kvstate import StateFormatError
from worker.engine.llama_state import Llama, StateReadError, StateRestoreError, read_seq_state, restore_seq_state
from worker.protocol import StoreStatus

log = logging.getLogger("kvpool.worker")

SIBLING_WAIT_S = 600.0
"""The longest a sequence waits for a prefix another sequence of its context is evaluating (a job's default timeout)."""


@dataclass
class Plan:
    cached_context: int = 0
    cached_store: int = 0
    store_depth: int = 0
    store_tokens: int = 0
    """Leading prompt tokens the store holds, to the token (full chunks and a tail)."""
    store_status: StoreStatus = "ok"
    decision: Decision | None = None
    """Restore or evaluate what the store holds past the context (`worker.cache.restore_choice`); None when it holds nothing more."""
    pending: Hit | None = None
    """What of the store's hit the decision restores, until `PrefixFinder.find` restores it."""
    local: int = 0
    """Leading prompt tokens the context held exactly when the job started."""
    published: bool = False
    claim: Claim | None = None
    """Leases on the chunks this job evaluates, until its publish is over."""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def start(self) -> int:
        """Cells kept; the prompt is evaluated from here."""
        return self.cached_context + self.cached_store

    @property
    def choice(self) -> Choice | None:
        return self.decision.choice if self.decision is not None else None

    def upto(self, tokens: list[int]) -> int:
        """Cells kept once the pending restore is made: the prompt is evaluated, and its chunks leased, from here."""
        return self.start if self.pending is None else max(self.start, min(self.pending.tokens, keepable(tokens)))


@dataclass
class PrefixFinder:
    """Finds and restores the deepest prefix of a prompt for one sequence (`Held`) from its context and the store."""

    held: Held
    store: Store | None
    checkpoints: Checkpoints | None
    """Set when this model's state is stored whole (`worker.cache.checkpoints`), not cut into cells."""
    leases: Leases | None
    eval_rate: EvalRate
    labels: dict[str, str]
    restore_enabled: bool
    name: str
    siblings: Collection[str] = frozenset()
    """The names of the sequences that share this one's context and engine loop (this one's among them)."""
    family: Sequence[Held] = ()
    """What each sequence of this context holds (this one's among them): a prefix a sibling holds is copied (`worker.cache.siblings`)."""
    restore_rate: RestoreRate = field(default_factory=RestoreRate)

    @property
    def llm(self) -> Llama:
        return self.held.llm

    @property
    def kv(self) -> ContextCache:
        return self.held.kv

    def find(self, ns: Namespace, tokens: list[int], keys: list[BlobKey]) -> Plan:
        """A job's prefix: decide (`prepare`), wait for another worker's publish where one is evaluating (`coalesce`), restore.

        A job that waited looks the store up again and decides again, as the store may hold
        more by then: the first decision was not acted on (nothing was restored before the
        wait), and only the one acted on is logged and counted.
        """
        plan = self.coalesce(ns, tokens, keys, self.prepare(ns, tokens, keys))
        try:
            if plan.pending is not None:
                self._restore(ns, tokens, keys, plan.local, plan.pending, plan)
                plan.pending = None
            self._report(plan)
        except BaseException:
            self.handoff(plan)()  # the job never starts: no one else would end the leases it took
            raise
        return plan

    def handoff(self, plan: Plan) -> Callable[[], None]:
        """Take the job's leases off the plan: whoever calls the result releases them, once."""
        claim, plan.claim = plan.claim, None
        leases = self.leases
        if claim is None or leases is None:
            return lambda: None
        return lambda: leases.release(claim)

    def prepare(self, ns: Namespace, tokens: list[int], keys: list[BlobKey]) -> Plan:
        """Find the deepest prefix available, locally or in the store, and decide what of the store's to restore (`Plan.pending`).

        The last two prompt tokens are always evaluated, never kept (see `batch_sizes`): the
        first sampled token then comes out of the same kernels whatever was reused. A
        checkpoint (a memory stored whole) is restored here at once: there is nothing to weigh.
        """
        plan = Plan(store_status="ok" if self.store else "disabled")
        plan.local = self.held.local_prefix(ns.tenant_salt, tokens)
        if len(self.family) > 1 and self.kv.cuttable and self.restore_enabled:
            plan.local = max(plan.local, self._from_sibling(ns.tenant_salt, tokens))
        plan.cached_context = min(plan.local, keepable(tokens))
        if self.checkpoints is not None:
            self._restore_checkpoint(ns, tokens, keys, plan.local, plan)
            return plan
        hit = self.store_hit(ns, tokens, keys, plan)
        if hit is not None and min(hit.tokens, keepable(tokens)) > plan.cached_context:
            plan.pending = self._worth_restoring(tokens, plan.local, hit, plan)
        return plan

    def _from_sibling(self, tenant: str, tokens: list[int]) -> int:
        """The prefix another sequence of this context holds, copied in (`worker.cache.siblings`); the cells held now, or 0."""
        try:
            return copy_from_sibling(self.held, self.family, tenant, tokens, keepable(tokens), self.labels)
        except (StateReadError, StateRestoreError, StateFormatError) as e:
            log.error("prefix.sibling_copy_failed", extra={"reason": str(e)})
            self.held.forget()
            return 0

    def _worth_restoring(self, tokens: list[int], n_local: int, hit: Hit, plan: Plan) -> Hit | None:
        """The part of ``hit`` whose restore, with the rest evaluated, is expected to be fastest; None: evaluate it all."""
        c, end = hit.chunk_size, keepable(tokens)
        local = n_local // c
        options = [Option(min(j * c, end), (j - local) * c) for j in range(local + 1, hit.depth + 1) if min(j * c, end) > n_local]
        if hit.tail is not None:
            options.append(Option(min(hit.tokens, end), (hit.depth - local) * c + len(hit.tail.tokens)))
        if not options:
            return hit
        d = plan.decision = choose(options, plan.cached_context, len(tokens), self.restore_rate, self.eval_rate)
        if d.choice == Choice.EVALUATE:
            return None
        if d.choice == Choice.PARTIAL and d.upto < min(hit.tokens, end):
            return Hit(depth=-(-d.upto // c), chunk_size=c)
        return hit

    def _report(self, plan: Plan) -> None:
        """Log and count the decision the job acted on, with the rates it was made from."""
        d = plan.decision
        if d is None:
            return
        metrics.RESTORE_CHOICES.labels(**self.labels, choice=d.choice).inc()
        if self.restore_rate.bytes_per_s is not None:
            metrics.RESTORE_RATE.labels(**self.labels).set(self.restore_rate.bytes_per_s)
        if self.eval_rate.tokens_per_s is not None:
            metrics.EVAL_RATE.labels(**self.labels).set(self.eval_rate.tokens_per_s)
        log.info(
            "restore.choice",
            extra={
                "choice": str(d.choice),
                "stored_tokens": plan.store_tokens,
                "restore_upto": d.upto,
                "restored_tokens": plan.cached_store,
                "restore_s": d.restore_s and round(d.restore_s, 4),
                "evaluate_s": d.evaluate_s and round(d.evaluate_s, 4),
                "cold_s": d.cold_s and round(d.cold_s, 4),
            },
        )

    def coalesce(self, ns: Namespace, tokens: list[int], keys: list[BlobKey], plan: Plan) -> Plan:
        """Lease the chunks this job will evaluate; where another worker is evaluating them, wait for its publish.

        The wait ends when the other worker's leases are gone (it published, or died and
        they expired), or after as long as evaluating those tokens here would take. Then
        the prefix is found again, and what is still missing is leased and evaluated here.
        A holder that is another sequence of this context is waited for until it releases
        (`SIBLING_WAIT_S` at most): evaluating the same tokens here would share its engine loop
        and cores, so it could only finish later and slow the holder down.
        """
        if self.leases is None or not self.restore_enabled or self.checkpoints is not None:
            return plan
        c = ns.chunk_size
        ahead = keys[plan.upto(tokens) // c :]
        try:
            claim, holders = self.leases.claim(ahead)
        except redis.RedisError as e:
            log.warning("lease.claim_failed", extra={"reason": str(e)})
            return plan
        plan.claim = claim
        n = leased_by_others(holders, self.name)
        if not n:
            return plan
        self.leases.release(claim)
        if all(h in self.siblings for h in holders[:n]):
            max_wait = SIBLING_WAIT_S
        else:
            max_wait = max(self.leases.min_wait_s, self.eval_rate.seconds_for(n * c, default_s=self.leases.lease_ms / 1000))
        t0 = time.perf_counter()
        outcome = self.leases.wait(ahead[:n], max_wait, getattr(self.llm, "watch", None))  # a client's cancel ends the wait
        waited = time.perf_counter() - t0
        metrics.LEASE_WAITS.labels(**self.labels, outcome=outcome).inc()
        metrics.LEASE_WAIT_SECONDS.labels(**self.labels).observe(waited)
        log.info("lease.waited", extra={"chunks": n, "outcome": outcome, "seconds": round(waited, 3)})
        timings = plan.timings
        if outcome == LeaseOutcome.RELEASED:
            plan = self.prepare(ns, tokens, keys)
        plan.timings = {**timings, **plan.timings, "lease_wait": waited}
        try:
            plan.claim, _ = self.leases.claim(keys[plan.upto(tokens) // c :])
        except redis.RedisError as e:
            log.warning("lease.claim_failed", extra={"reason": str(e)})
            plan.claim = None
        return plan

    def store_hit(self, ns: Namespace, tokens: list[int], keys: list[BlobKey], plan: Plan) -> Hit | None:
        """How much of the prompt the store holds; None when it cannot help."""
        if self.store is None or len(tokens) < 3:
            return None
        if not self.restore_enabled:
            metrics.COLD_FALLBACKS.labels(**self.labels, reason="restore_disabled").inc()
            return None
        t0 = time.perf_counter()
        try:
            hit = self.store.find(ns, tokens, keys)
        except StoreUnavailable as e:
            plan.store_status = "unavailable"
            metrics.COLD_FALLBACKS.labels(**self.labels, reason="store_unavailable").inc()
            log.warning("store.unavailable", extra={"endpoint": e.endpoint, "reason": e.reason})
            return None
        plan.timings["lookup"] = time.perf_counter() - t0
        plan.store_depth, plan.store_tokens = hit.depth, hit.tokens
        return hit

    def _restore(self, ns: Namespace, tokens: list[int], keys: list[BlobKey], n_local: int, hit: Hit, plan: Plan) -> None:
        """Fetch what the store adds past the local chunks, join it with them and restore the whole prefix."""
        c = ns.chunk_size
        local_chunks = n_local // c
        t1 = time.perf_counter()
        try:
            got = self.store.fetch_prefix(ns, tokens, keys, local_chunks, hit) if self.store else Fetched([])
        except StoreError as e:
            plan.store_status = "unavailable"
            log.warning("store.fetch_failed", extra={"reason": str(e)})
            got = Fetched([])
        plan.timings["fetch"] = time.perf_counter() - t1
        if local_chunks + len(got.chunks) < hit.depth or (hit.tail is not None and got.tail is None):
            metrics.COLD_FALLBACKS.labels(**self.labels, reason="fetch_failed").inc()
        remote: list[memoryview | bytes] = list(got.chunks)
        n_restore = (local_chunks + len(remote)) * c
        tail_cells = min(hit.tail.usable, keepable(tokens) - n_restore) if hit.tail and got.tail is not None else 0
        if tail_cells > 0:
            remote.append(head_cells(got.tail, tail_cells))  # type: ignore[arg-type]
            n_restore += tail_cells
        if n_restore <= n_local:
            return
        t2 = time.perf_counter()
        try:
            local = cut_state(read_seq_state(self.llm), c, 0, local_chunks) if local_chunks else []
            restore_seq_state(self.llm, join_state([*local, *remote], v_trans=self.kv.v_trans), tokens[:n_restore])
        except (StateReadError, StateRestoreError, StateFormatError) as e:
            metrics.COLD_FALLBACKS.labels(**self.labels, reason="restore_failed").inc()
            log.error("restore.failed", extra={"reason": str(e), "chunks": local_chunks + len(remote)})
            self.held.forget()
            plan.cached_context = 0
            return
        plan.timings["restore"] = time.perf_counter() - t2
        self.held.hold(ns.tenant_salt, n_restore)
        fetched = sum(len(p) for p in got.chunks) + (len(got.tail) if got.tail is not None else 0)
        fetched_tokens = len(got.chunks) * c + (len(hit.tail.tokens) if hit.tail and got.tail is not None else 0)
        self.restore_rate.observe(fetched, fetched_tokens, time.perf_counter() - t1)
        metrics.RESTORE_SECONDS.labels(**self.labels).observe(time.perf_counter() - t1)
        metrics.RESTORE_BYTES.labels(**self.labels).inc(sum(len(p) for p in remote))
        plan.cached_context = min(local_chunks * c, keepable(tokens))
        plan.cached_store = min(n_restore, keepable(tokens)) - plan.cached_context

    def _restore_checkpoint(self, ns: Namespace, tokens: list[int], keys: list[BlobKey], n_local: int, plan: Plan) -> None:
        """For a memory stored whole (`store.checkpoints`): restore the deepest checkpoint the prompt continues, if it beats the context."""
        if self.store is None or self.checkpoints is None or len(tokens) < 3:
            return
        t0 = time.perf_counter()
        try:
            found = self.checkpoints.find(ns, tokens, keys, keepable(tokens))
        except StoreUnavailable as e:
            plan.store_status = "unavailable"
            metrics.COLD_FALLBACKS.labels(**self.labels, reason="store_unavailable").inc()
            log.warning("store.unavailable", extra={"endpoint": e.endpoint, "reason": e.reason})
            return
        plan.timings["lookup"] = time.perf_counter() - t0
        plan.store_depth, plan.store_tokens = found.depth, found.tokens
        t1 = time.perf_counter()
        payload = None
        while found.tokens > n_local:  # a missing or bad checkpoint leaves the index: the one before it may serve
            payload = self.checkpoints.fetch_found(ns, tokens, keys, found)
            if payload is not None:
                break
            metrics.COLD_FALLBACKS.labels(**self.labels, reason="fetch_failed").inc()
            try:
                found = self.checkpoints.find(ns, tokens, keys, found.tokens - 1)
            except StoreUnavailable:
                break
        plan.timings["fetch"] = time.perf_counter() - t1
        if payload is None:
            return
        n = found.tokens
        t2 = time.perf_counter()
        try:
            restore_checkpoint(self.llm, payload, tokens[:n], self.kv.n_swa)
        except StateRestoreError as e:
            metrics.COLD_FALLBACKS.labels(**self.labels, reason="restore_failed").inc()
            log.error("restore.failed", extra={"reason": str(e), "checkpoint": n})
            self.held.forget()
            plan.cached_context = 0
            return
        plan.timings["restore"] = time.perf_counter() - t2
        self.held.hold(ns.tenant_salt, n)
        metrics.RESTORE_SECONDS.labels(**self.labels).observe(time.perf_counter() - t1)
        metrics.RESTORE_BYTES.labels(**self.labels).inc(len(payload))
        plan.cached_context, plan.cached_store = 0, n


def keepable(tokens: list[int]) -> int:
    """The most prompt cells a job keeps: the last two tokens are always evaluated."""
    return max(len(tokens) - 2, 0)
