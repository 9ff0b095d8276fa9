"""Where a job goes: cache-aware routing, backpressure, and submission.

Routing: every live worker advertises the chain keys its context holds (`worker.advert`).
A request goes to the private queue of the worker holding the deepest part of its chain
when that worker is free (not busy, its queue within ``route_max_queue``); otherwise to
the shared queue, where any idle worker takes it and restores the prefix from the store.
Every decision is counted with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
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


def choose(ads: list[Advert], chain: list[str], queue_lengths: dict[str, int], shared: str, max_queue: int) -> Route:
    """The routing rule, as a plain function of what the workers advertise."""
    best = max(ads, key=lambda a: a.depth(chain), default=None)
    depth = best.depth(chain) if best else 0
    if best is None or depth == 0:
        return Route(shared, "no_holder")
    if best.busy or queue_lengths.get(best.worker, 0) > max_queue:
        return Route(shared, "holder_busy", best.worker, depth)
    return Route(worker_queue(best.worker), "locality", best.worker, depth)


class Dispatcher:
    def __init__(self, conn: redis.Redis, settings: GatewaySettings) -> None:
        self.conn = conn
        self.settings = settings

    def _lengths(self, names: list[str]) -> dict[str, int]:
        pipe = self.conn.pipeline(transaction=False)
        for n in names:
            pipe.llen(Queue(worker_queue(n), connection=self.conn).key)
        pipe.llen(Queue(self.settings.queue, connection=self.conn).key)
        *per_worker, shared = pipe.execute()
        return {**dict(zip(names, per_worker)), "": shared}

    def dispatch(self, spec: JobSpec, *, depends_on: str | None = None, job_id: str | None = None) -> tuple[str, Route]:
        """Check capacity, route and enqueue; returns the job id and the route taken."""
        ads = adverts(self.conn)
        if not ads:
            metrics.REJECTED.labels("no_worker").inc()
            raise Overloaded("no live worker is serving this pool; start one with `kvpool worker`", code="no_workers", headers={"Retry-After": "5"})
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
        route = choose(ads, spec.chain, lengths, self.settings.queue, self.settings.route_max_queue)
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
