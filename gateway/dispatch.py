"""Where a job goes: cache-aware routing, backpressure, and submission.

Routing: every live worker advertises the chain keys its context holds (`worker.advert`).
A request goes to the private queue of the worker holding the deepest part of its chain
when that worker is free (not busy, its queue within ``route_max_queue``); otherwise to
the shared queue, where any idle worker takes it and restores the prefix from the store.
Every decision is counted with its reason.

A pool whose workers differ in KV layout or kernels (`worker.kernels`: a mixed fleet of
CPU generations) keeps one blob chain per layout, and a worker restores only from its
own. There, the gateway also asks the index how deep each live layout's chain of the
prompt is stored (one chain hash per layout, one round trip; a pool of one layout skips
this), and when one layout's blobs reach deeper than the deepest worker context, the job
goes to a free worker of that layout (``store_layout``), or to the shared queue when all
of them are busy (``store_layout_busy``). What the gateway cannot know is which layout
will have published most by the time a queued job starts.

Admission is atomic within a gateway: the capacity check and the enqueue happen under
one lock, so a burst cannot overshoot ``max_waiting_jobs`` (with several gateways, by at
most one request each). A request is also refused, with 503 and Retry-After, when the
queue ahead of it would not let it start and finish within its deadline, judged by the
mean time of recent jobs: better an honest "retry later" than an accepted request that
rots in the queue.

With ``queue_without_workers`` a pool may have no live worker at all (scaled to zero on
the shared queue's length): the job then waits in the shared queue, which is what wakes
the autoscaler, and the first worker to start takes it. Without it, a request finding no
live worker gets 503 (`NoLiveWorker`), unless the pool is starting: `gateway.starting`
waits for its first worker first.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import redis
import xxhash

from gateway import metrics
from gateway.errors import Overloaded
from gateway.settings import GatewaySettings
from store.chain import chain_keys, namespace_key
from store.errors import StoreUnavailable
from store.index import RedisIndex
from worker.advert import Advert, adverts
from worker.client import job_exists, queue_key, submit
from worker.protocol import JobSpec, worker_queue
from worker.redis_retry import ride_out


class RouteReason(StrEnum):
    """Why a job went where it went: the ``reason`` label of ``kvpool_gateway_routed_total``."""

    LOCALITY = "locality"
    """To the private queue of the free worker whose context holds the deepest part of the chain."""
    HOLDER_BUSY = "holder_busy"
    """A worker holds part of the chain but is busy or its queue is long: the shared queue."""
    NO_HOLDER = "no_holder"
    """No worker holds any of the chain: the shared queue."""
    BATCH_DEPENDENT = "batch_dependent"
    """A batch sibling waiting for its leader (an RQ dependent): the shared queue."""
    STORE_LAYOUT = "store_layout"
    """In a pool of several layouts: to a free worker of the layout whose stored chunks reach deepest."""
    STORE_LAYOUT_BUSY = "store_layout_busy"
    """The same, but every worker of that layout is busy: the shared queue."""
    CACHE_KEY = "cache_key"
    """No worker holds any of the prefix: to the worker the request's ``prompt_cache_key`` hashes to."""
    CACHE_KEY_BUSY = "cache_key_busy"
    """The same, but too many jobs wait there: the shared queue."""


class RejectReason(StrEnum):
    """Why a request was turned away before enqueueing: the ``reason`` label of ``kvpool_gateway_rejected_total``."""

    NO_MATCHING_WORKER = "no_matching_worker"
    NO_WORKER = "no_worker"
    QUEUE_FULL = "queue_full"
    DEADLINE = "deadline"


class NoLiveWorker(Overloaded):
    """No worker is live to send a job to (503, ``no_workers``); a starting pool's request waits for one (`gateway.starting`)."""

    def __init__(
        self, message: str = "no live worker is serving this pool; start one with `kvpool worker`", retry_after_s: int = 5
    ) -> None:
        super().__init__(message, code="no_workers", headers={"Retry-After": str(retry_after_s)})


@dataclass(frozen=True)
class Route:
    queue: str
    reason: RouteReason
    worker: str | None = None
    depth: int = 0


def choose(
    ads: list[Advert],
    chain: list[str],
    queue_lengths: dict[str, int],
    shared: str,
    max_queue: int,
    stored: Mapping[str, int] | None = None,
    route_key: str | None = None,
    key_max_queue: int = 0,
) -> Route:
    """The routing rule, as a plain function of what the workers advertise and (``stored``) how deep each layout's blobs go.

    While no worker holds any of the prefix, a request with a ``prompt_cache_key``
    (``route_key``) goes to the worker that key hashes to (rendezvous hashing over the live
    workers' names, so a worker joining or leaving moves only its own keys), busy or not,
    while at most ``key_max_queue`` jobs wait there: a burst sharing a new prefix then
    lands on one worker, which evaluates the prefix once and serves the rest from its context.
    """
    best = max(ads, key=lambda a: a.depth(chain), default=None)
    depth = best.depth(chain) if best else 0
    layouts, store_depth = _deepest_layouts(stored or {})
    if store_depth > depth:
        free = [a for a in ads if a.layout in layouts and not a.busy and queue_lengths.get(a.worker, 0) <= max_queue]
        if not free:
            return Route(shared, RouteReason.STORE_LAYOUT_BUSY, None, store_depth)
        pick = min(free, key=lambda a: (queue_lengths.get(a.worker, 0), -a.depth(chain), a.worker))
        return Route(worker_queue(pick.worker), RouteReason.STORE_LAYOUT, pick.worker, store_depth)
    if best is None or depth == 0:
        if route_key is not None and ads:
            keyed = max(ads, key=lambda a: xxhash.xxh3_64_intdigest(f"{route_key}\0{a.worker}".encode()))
            if queue_lengths.get(keyed.worker, 0) <= key_max_queue:
                return Route(worker_queue(keyed.worker), RouteReason.CACHE_KEY, keyed.worker)
            return Route(shared, RouteReason.CACHE_KEY_BUSY, keyed.worker)
        return Route(shared, RouteReason.NO_HOLDER)
    if best.busy or queue_lengths.get(best.worker, 0) > max_queue:
        return Route(shared, RouteReason.HOLDER_BUSY, best.worker, depth)
    return Route(worker_queue(best.worker), RouteReason.LOCALITY, best.worker, depth)


def _deepest_layouts(stored: Mapping[str, int]) -> tuple[set[str], int]:
    """The layouts whose blobs hold the most chunks of a prompt, and how many; nothing when every layout holds as many."""
    if not stored or max(stored.values()) == min(stored.values()):
        return set(), 0
    top = max(stored.values())
    return {layout for layout, d in stored.items() if d == top}, top


def stored_depths(index: RedisIndex, ads: list[Advert], spec: JobSpec) -> dict[str, int]:
    """How many leading chunks of the job's prompt each live layout's blob chain holds; empty for a pool of one layout."""
    layouts = sorted({a.layout for a in ads if a.layout})
    if len(layouts) < 2:
        return {}
    chains = [
        chain_keys(namespace_key(spec.model, layout, spec.chunk_size, spec.tenant_salt), spec.tokens, spec.chunk_size) for layout in layouts
    ]
    try:
        return dict(zip(layouts, index.deepest_many(chains)))
    except StoreUnavailable:  # routing without it is still right; the enqueue that follows waits for Redis
        return {}


def mismatch(live: list[Advert], model: str, chunk_size: int) -> str:
    """Why none of the live workers can run this gateway's jobs, for an operator to fix."""
    seen = sorted({f"model {a.model[:12] or '?'} / chunk size {a.chunk_size or '?'}" for a in live})
    return (
        f"{len(live)} live worker(s) serve {', '.join(seen)}; this gateway sends model {model[:12]} / chunk size "
        f"{chunk_size}: start the gateway with the workers' KVPOOL_MODEL and KVPOOL_CHUNK_SIZE"
    )


class JobTime:
    """Exponentially weighted mean of recent jobs' durations, seconds (None until one was seen)."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.mean: float | None = None

    def observe(self, seconds: float) -> None:
        self.mean = seconds if self.mean is None else (1 - self.weight) * self.mean + self.weight * seconds


def expected_finish_s(waiting: int, workers: int, mean_job_s: float | None) -> float | None:
    """When a request enqueued now would be answered: the jobs ahead shared among the workers, then its own."""
    if mean_job_s is None or workers <= 0:
        return None
    return (waiting / workers + 1) * mean_job_s


class Dispatcher:
    def __init__(self, conn: redis.Redis[bytes], settings: GatewaySettings) -> None:
        self.conn = conn
        self.settings = settings
        self.job_time = JobTime()
        self._admit = threading.Lock()
        self.index = RedisIndex(conn)

    def _lengths(self, names: list[str]) -> dict[str, int]:
        pipe = self.conn.pipeline(transaction=False)
        for n in names:
            pipe.llen(queue_key(worker_queue(n)))
        pipe.llen(queue_key(self.settings.queue))
        *per_worker, shared = pipe.execute()
        return {**dict(zip(names, per_worker)), "": shared}

    def dispatch(
        self, spec: JobSpec, *, depends_on: str | None = None, job_id: str | None = None, count_no_worker: bool = True
    ) -> tuple[str, Route]:
        """Check capacity, route and enqueue, atomically within this gateway; returns the job id and the route taken.

        With no live worker it raises `NoLiveWorker`, counted as a rejection unless
        ``count_no_worker`` is False (a caller that may wait for a starting pool counts its own).

        A Redis that is restarting is waited for, up to ``redis_outage_s``: a restart takes
        about a second, and a request should not fail for it. Redis may have run an enqueue
        and lost only its reply, so the job id is fixed before the first try, and a try after
        a failed one first looks for the job: a job is never enqueued twice.
        """
        job_id = job_id or str(uuid.uuid4())
        routed: list[Route] = []

        def admit() -> tuple[str, Route]:
            with self._admit:
                if routed and job_exists(self.conn, job_id):
                    return job_id, routed[-1]
                route = self._route(spec, depends_on)
                routed.append(route)
                submit(
                    self.conn,
                    spec,
                    queue=route.queue,
                    attempts=self.settings.job_attempts,
                    timeout_s=self.settings.job_timeout_s,
                    job_id=job_id,
                    depends_on=depends_on,
                )
                return job_id, route

        try:
            return ride_out(admit, self.settings.redis_outage_s, what="dispatch")
        except NoLiveWorker:
            if count_no_worker:
                metrics.REJECTED.labels(RejectReason.NO_WORKER).inc()
            raise

    def requeue(self, spec: JobSpec, job_id: str) -> None:
        """Submit an admitted job again (Redis lost it) to the shared queue, without a new admission check."""
        submit(
            self.conn,
            spec,
            queue=self.settings.queue,
            attempts=self.settings.job_attempts,
            timeout_s=self.settings.job_timeout_s,
            job_id=job_id,
        )

    def _route(self, spec: JobSpec, depends_on: str | None) -> Route:
        """Admission (`Overloaded` when the pool cannot answer in time) and the queue the job goes to."""
        live = adverts(self.conn)
        ads = [a for a in live if a.serves(spec.model, spec.chunk_size)]
        if live and not ads:
            metrics.REJECTED.labels(RejectReason.NO_MATCHING_WORKER).inc()
            raise Overloaded(mismatch(live, spec.model, spec.chunk_size), code="no_matching_worker", headers={"Retry-After": "30"})
        if not ads and not self.settings.queue_without_workers:
            raise NoLiveWorker()
        lengths = self._lengths([a.worker for a in ads])
        waiting = sum(lengths.values())
        metrics.QUEUE_DEPTH.set(waiting)
        if waiting >= self.settings.max_waiting_jobs:
            metrics.REJECTED.labels(RejectReason.QUEUE_FULL).inc()
            raise Overloaded(
                f"{waiting} jobs are already waiting (limit {self.settings.max_waiting_jobs}); retry shortly",
                code="queue_full",
                headers={"Retry-After": "2"},
            )
        finish = expected_finish_s(waiting, len(ads), self.job_time.mean)
        if depends_on is None and finish is not None and finish > self.settings.request_timeout_s:
            metrics.REJECTED.labels(RejectReason.DEADLINE).inc()
            raise Overloaded(
                f"{waiting} jobs are waiting for {len(ads)} worker(s); this request would not be answered within "
                f"{self.settings.request_timeout_s:.0f} s (about {finish:.0f} s); retry later",
                code="queue_full",
                headers={"Retry-After": str(max(1, min(60, int(finish - self.settings.request_timeout_s))))},
            )
        stored = stored_depths(self.index, ads, spec) if depends_on is None else {}
        route = choose(
            ads,
            spec.chain,
            lengths,
            self.settings.queue,
            self.settings.route_max_queue,
            stored,
            spec.route_key,
            self.settings.cache_key_max_queue,
        )
        if depends_on is not None:
            route = Route(self.settings.queue, RouteReason.BATCH_DEPENDENT)
        metrics.ROUTED.labels(route.reason).inc()
        return route
