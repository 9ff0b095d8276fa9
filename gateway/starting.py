"""A starting pool does not turn requests away: a request waits for its first worker.

A request that finds no live worker (`gateway.dispatch.NoLiveWorker`) asks what the pool
is (`worker.advert.apool_view`, one round trip):

* **starting**: worker processes are announced as starting (spawned, loading their model:
  `worker.process.starting`), or no worker of this model and chunk size has ever advertised in
  this Redis (a new pool, whose workers may not even be spawned yet). The request waits
  for a worker, up to ``KVPOOL_START_WAIT_S`` from its arrival and never past its own
  deadline (``KVPOOL_REQUEST_TIMEOUT_S`` counts the wait), and is then dispatched as any
  other; if none came, 503 ``no_workers`` saying the pool is still starting.
* **down**: workers of this pool were live and none is, and none is starting (they died
  or were stopped): 503 at once, as a pool without workers always answered.

With ``KVPOOL_QUEUE_WITHOUT_WORKERS`` nothing waits here: the job waits in the shared
queue instead. The wait holds no thread (asyncio), and one read of Redis every `POLL_S`
serves every waiting request. `models_unavailable` is the same question for ``/v1/models``,
which answers 503 until a worker is live, so that a client polling it for 200 before
sending (as it would llama-server's) sends once the pool can answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from enum import StrEnum
from functools import partial

import redis
import redis.asyncio
from starlette.concurrency import run_in_threadpool

from gateway import metrics
from gateway.dispatch import Dispatcher, NoLiveWorker, RejectReason, Route, mismatch
from gateway.errors import APIError, Overloaded
from gateway.settings import GatewaySettings
from worker.advert import PoolView, apool_view
from worker.protocol import JobSpec

log = logging.getLogger("kvpool.gateway")

POLL_S = 0.25
"""How often a waiting request's gateway reads the pool from Redis (once for all its waiting requests)."""


class PoolState(StrEnum):
    LIVE = "live"
    """A worker serving this gateway's model and chunk size advertises."""
    STARTING = "starting"
    """None does, but worker processes are starting, or none ever advertised in this Redis."""
    DOWN = "down"
    """None does, none is starting, and some did: the workers died or were stopped."""


class StartingPool:
    """Dispatch that waits for a starting pool's first worker; what ``/v1/models`` answers meanwhile."""

    def __init__(self, aredis: redis.asyncio.Redis[bytes], dispatcher: Dispatcher, settings: GatewaySettings, model: str) -> None:
        self.aredis = aredis
        self.dispatcher = dispatcher
        self.settings = settings
        self.model = model
        self._lock = asyncio.Lock()
        self._view: PoolView | None = None
        self._read_at = 0.0

    def state(self, view: PoolView) -> PoolState:
        if any(a.serves(self.model, self.settings.chunk_size) for a in view.live):
            return PoolState.LIVE
        return PoolState.STARTING if view.starting or not view.seen else PoolState.DOWN

    async def view(self, *, fresh: bool = False) -> PoolView:
        """The pool as Redis says, read at most once every `POLL_S` for all requests (``fresh``: read now)."""
        async with self._lock:
            if fresh or self._view is None or time.monotonic() - self._read_at >= POLL_S:
                self._view = await apool_view(self.aredis, self.model, self.settings.chunk_size)
                self._read_at = time.monotonic()
            return self._view

    async def wait(self, until: float) -> tuple[PoolState, PoolView | None]:
        """Until a worker is live, the pool is down, or ``until`` (`time.perf_counter`) passes (then STARTING).

        Its first look is its own (what another request read a moment ago may be older than
        this request's refusal); the next ones share one read every `POLL_S`.
        """
        first = True
        while True:
            view: PoolView | None = None
            try:
                view = await self.view(fresh=first)
                state = self.state(view)
            except redis.RedisError:  # Redis away: the dispatch after the wait rides it out, or says so
                state = PoolState.STARTING
            left = until - time.perf_counter()
            if state is not PoolState.STARTING or left <= 0:
                return state, view
            if first:
                log.info("request.waiting_for_worker", extra={"wait_s": round(left, 3), "starting": view.starting if view else None})
                first = False
            await asyncio.sleep(min(POLL_S, left))

    async def dispatch(self, spec: JobSpec, job_id: str | None, t0: float) -> tuple[str, Route]:
        """`Dispatcher.dispatch`, waiting for a worker while the pool is starting; ``t0`` is when the request arrived."""
        until = t0 + min(self.settings.start_wait_s, self.settings.request_timeout_s)
        live_before = False
        while True:
            try:
                return await run_in_threadpool(partial(self.dispatcher.dispatch, spec, job_id=job_id, count_no_worker=False))
            except NoLiveWorker as e:
                state, view = (PoolState.DOWN, None) if self.settings.start_wait_s <= 0 else await self.wait(until)
                if state is PoolState.LIVE and not (live_before and time.perf_counter() >= until):
                    if live_before:  # live, yet refused again (the worker went in between): not in a tight loop
                        await asyncio.sleep(POLL_S)
                    live_before = True
                    continue
                metrics.REJECTED.labels(RejectReason.NO_WORKER).inc()
                if state is PoolState.DOWN:
                    raise
                raise self._still_starting(time.perf_counter() - t0, view) from e

    def _still_starting(self, waited_s: float, view: PoolView | None) -> NoLiveWorker:
        bound = "KVPOOL_START_WAIT_S" if self.settings.start_wait_s <= self.settings.request_timeout_s else "KVPOOL_REQUEST_TIMEOUT_S"
        loading = f"; {view.starting} worker(s) loading" if view is not None and view.starting else ""
        return NoLiveWorker(
            f"no live worker is serving this pool yet: it is starting, and no worker became live within {waited_s:.1f} s "
            f"({bound}){loading}; retry shortly"
        )

    async def models_unavailable(self) -> APIError | None:
        """Why ``/v1/models`` answers 503 now (no worker can take a job, as llama-server while its model loads), or None."""
        if self.settings.queue_without_workers:
            return None
        view = await self.view()
        state = self.state(view)
        if state is PoolState.LIVE:
            return None
        if state is PoolState.STARTING:
            loading = f" ({view.starting} worker(s) loading)" if view.starting else ""
            return NoLiveWorker(f"the pool is starting: no worker is live yet{loading}; retry shortly", retry_after_s=1)
        if view.live:
            return Overloaded(
                mismatch(view.live, self.model, self.settings.chunk_size), code="no_matching_worker", headers={"Retry-After": "30"}
            )
        return NoLiveWorker()
