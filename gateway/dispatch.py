"""Where a job goes: cache-aware routing, backpressure, and submission.

Routing: every live worker advertises the chain keys its context holds (`worker.advert`).
A request goes to the private queue of the worker holding the deepest part of its chain
when that worker is free (not busy, its queue within ``route_max_queue``); otherwise to
the shared queue, where any idle worker takes it and restores the prefix from the store.
Every decision is counted with its reason.

Admission is atomic within a gateway: the capacity check and the enqueue happen under
one lock, so a burst cannot overshoot ``max_waiting_jobs`` (with several gateways, by at
most one request each). A request is also refused, with 503 and Retry-After, when the
queue ahead of it would not let it start and finish within its deadline, judged by the
mean time of recent jobs: better an honest "retry later" than an accepted request that
rots in the queue.

With ``queue_without_workers`` a pool may have no live worker at all (scaled to zero on
the shared queue's length): the job then waits in the shared queue, which is what wakes
the autoscaler, and the first worker to start takes it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import redis
import xxhash
from rq import Queue

from gateway import metrics
from gateway.errors import Overloaded
from gateway.settings import GatewaySettings
from worker.advert import Advert, adverts
from worker.client import submit
from worker.protocol import JobSpec, worker_queue


@dataclass(frozen=True)
class Route:
    queue: str
    reason: str
    worker: str | None = None
    depth: int = 0


def choose(
    ads: list[Advert],
    chain: list[str],
    queue_lengths: dict[str, int],
    shared: str,
    max_queue: int,
    route_key: str | None = None,
    key_max_queue: int = 0,
) -> Route:
    """The routing rule, as a plain function of what the workers advertise.

    While no worker holds any of the prefix, a request with a ``prompt_cache_key``
    (``route_key``) goes to the worker that key hashes to (rendezvous hashing over the live
    workers' names, so a worker joining or leaving moves only its own keys), busy or not,
    while at most ``key_max_queue`` jobs wait there: a burst sharing a new prefix then
    lands on one worker, which evaluates the prefix once and serves the rest from its context.
    """
    best = max(ads, key=lambda a: a.depth(chain), default=None)
    depth = best.depth(chain) if best else 0
    if best is None or depth == 0:
        if route_key is not None and ads:
            keyed = max(ads, key=lambda a: xxhash.xxh3_64_intdigest(f"{route_key}\0{a.worker}".encode()))
            if queue_lengths.get(keyed.worker, 0) <= key_max_queue:
                return Route(worker_queue(keyed.worker), "cache_key", keyed.worker)
            return Route(shared, "cache_key_busy", keyed.worker)
        return Route(shared, "no_holder")
    if best.busy or queue_lengths.get(best.worker, 0) > max_queue:
        return Route(shared, "holder_busy", best.worker, depth)
    return Route(worker_queue(best.worker), "locality", best.worker, depth)


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
    def __init__(self, conn: redis.Redis, settings: GatewaySettings) -> None:
        self.conn = conn
        self.settings = settings
        self.job_time = JobTime()
        self._admit = threading.Lock()

    def _lengths(self, names: list[str]) -> dict[str, int]:
        pipe = self.conn.pipeline(transaction=False)
        for n in names:
            pipe.llen(Queue(worker_queue(n), connection=self.conn).key)
        pipe.llen(Queue(self.settings.queue, connection=self.conn).key)
        *per_worker, shared = pipe.execute()
        return {**dict(zip(names, per_worker)), "": shared}

    def dispatch(self, spec: JobSpec, *, depends_on: str | None = None, job_id: str | None = None) -> tuple[str, Route]:
        """Check capacity, route and enqueue, atomically within this gateway; returns the job id and the route taken.

        A Redis that is restarting is waited for, up to ``redis_outage_s``: a restart takes
        about a second, and a request should not fail for it.
        """
        deadline = time.monotonic() + self.settings.redis_outage_s
        wait = 0.1
        while True:
            try:
                with self._admit:
                    return self._dispatch(spec, depends_on, job_id)
            except (redis.ConnectionError, redis.TimeoutError):
                if time.monotonic() + wait > deadline:
                    raise
                time.sleep(wait)
                wait = min(2 * wait, 1.0)

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

    def _dispatch(self, spec: JobSpec, depends_on: str | None, job_id: str | None) -> tuple[str, Route]:
        live = adverts(self.conn)
        ads = [a for a in live if a.serves(spec.model, spec.chunk_size)]
        if live and not ads:
            metrics.REJECTED.labels("no_matching_worker").inc()
            raise Overloaded(mismatch(live, spec.model, spec.chunk_size), code="no_matching_worker", headers={"Retry-After": "30"})
        if not ads and not self.settings.queue_without_workers:
            metrics.REJECTED.labels("no_worker").inc()
            raise Overloaded(
                "no live worker is serving this pool; start one with `kvpool worker`", code="no_workers", headers={"Retry-After": "5"}
            )
        lengths = self._lengths([a.worker for a in ads])
        waiting = sum(lengths.values())
        metrics.QUEUE_DEPTH.set(waiting)
        if waiting >= self.settings.max_waiting_jobs:
            metrics.REJECTED.labels("queue_full").inc()
            raise Overloaded(
                f"{waiting} jobs are already waiting (limit {self.settings.max_waiting_jobs}); retry shortly",
                code="queue_full",
                headers={"Retry-After": "2"},
            )
        finish = expected_finish_s(waiting, len(ads), self.job_time.mean)
        if depends_on is None and finish is not None and finish > self.settings.request_timeout_s:
            metrics.REJECTED.labels("deadline").inc()
            raise Overloaded(
                f"{waiting} jobs are waiting for {len(ads)} worker(s); this request would not be answered within "
                f"{self.settings.request_timeout_s:.0f} s (about {finish:.0f} s); retry later",
                code="queue_full",
                headers={"Retry-After": str(max(1, min(60, int(finish - self.settings.request_timeout_s))))},
            )
        route = choose(
            ads, spec.chain, lengths, self.settings.queue, self.settings.route_max_queue, spec.route_key, self.settings.cache_key_max_queue
        )
        if depends_on is not None:
            route = Route(self.settings.queue, "batch_dependent")
        metrics.ROUTED.labels(route.reason).inc()
        job = submit(
            self.conn,
            spec,
            queue=route.queue,
            attempts=self.settings.job_attempts,
            timeout_s=self.settings.job_timeout_s,
            job_id=job_id,
            depends_on=depends_on,
        )
        return job.id, route
