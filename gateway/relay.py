"""Relaying one job's events to its HTTP client, whatever happens to the client, the worker or Redis.

`relay` yields the job's token events (each once, even when a retried attempt replays
them) and then its `JobResult`, or raises an `APIError` that names the failure. Every
`CHECK_S` seconds, and whenever the stream is quiet, it checks:

* the deadline: past it, the job is cancelled and the client gets a 504;
* the client: gone, and the job is cancelled (streaming or not);
* the worker: gone with no other worker alive, and the client gets a 502 at once
  instead of waiting for a retry that nobody will run;
* the job itself: a Redis that restarted without its data has lost the queued job, so
  the gateway, which still holds the spec, submits it again under the same id; a job
  popped by a worker that died before starting it is put back in the shared queue
  (`worker.client.arequeue_stranded`).

A Redis that restarts mid-stream only pauses the relay: reading resumes after the last
entry seen. The events come from the gateway's one reader of job streams (`gateway.streams`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

import anyio
import redis
import redis.asyncio
from starlette.requests import Request

from gateway import metrics
from gateway.errors import Timeout, WorkerFailed
from gateway.streams import StreamReader
from worker.advert import ais_live
from worker.client import arequeue_stranded, job_key
from worker.protocol import DoneEvent, ErrorEvent, JobResult, StartEvent, TokenEvent, cancel_key

log = logging.getLogger("kvpool.gateway")

CHECK_S = 2.0


@dataclass
class RelayContext:
    request: Request
    aredis: redis.asyncio.Redis[bytes]
    reader: StreamReader
    job_id: str
    queue: str
    """The shared queue, where a stranded job is put back."""
    t0: float
    timeout_s: float
    endpoint: str
    any_worker_alive: Callable[[], Awaitable[bool]]
    resubmit: Callable[[], Awaitable[None]]
    job_seconds: Callable[[float], None]


@dataclass
class _Attempt:
    worker: str | None = None
    tokens: int = 0


async def relay(ctx: RelayContext) -> AsyncGenerator[TokenEvent | JobResult]:
    attempt = _Attempt()
    emitted = 0
    next_check = time.monotonic() + CHECK_S
    finished = False
    try:
        async for ev in ctx.reader.events(ctx.job_id):
            if time.perf_counter() > ctx.t0 + ctx.timeout_s:
                metrics.CANCELLED.labels("timeout").inc()
                raise Timeout(f"no answer within {ctx.timeout_s:.0f} s; the job was cancelled", code="timeout")
            if ev is None or time.monotonic() > next_check:
                next_check = time.monotonic() + CHECK_S
                await _check(ctx, attempt)
            if isinstance(ev, StartEvent):
                attempt = _Attempt(worker=ev.worker)
            elif isinstance(ev, TokenEvent):
                attempt.tokens += 1
                if attempt.tokens > emitted:  # a retried attempt replays tokens the client already has
                    emitted += 1
                    if emitted == 1:
                        metrics.FIRST_TOKEN.labels(ctx.endpoint).observe(time.perf_counter() - ctx.t0)
                    yield ev
            elif isinstance(ev, ErrorEvent) and not ev.retrying:
                raise WorkerFailed(f"the worker failed: {ev.error}", code="worker_error")
            elif isinstance(ev, DoneEvent):
                _count_done(ev.result, ctx)
                finished = True
                yield ev.result
                return
    finally:
        if not finished:
            with anyio.CancelScope(shield=True):
                await _cancel(ctx)


async def _check(ctx: RelayContext, attempt: _Attempt) -> None:
    if await ctx.request.is_disconnected():
        metrics.CANCELLED.labels("client_gone").inc()
        raise asyncio.CancelledError
    try:
        if attempt.worker is not None and not await ais_live(ctx.aredis, attempt.worker):
            if not await ctx.any_worker_alive():
                raise WorkerFailed(f"worker {attempt.worker} died while answering and no other worker is alive", code="worker_lost")
        if not await ctx.aredis.exists(job_key(ctx.job_id)):
            log.warning("job.lost", extra={"job": ctx.job_id, "reason": "Redis no longer holds it; submitting it again"})
            metrics.RESUBMITTED.labels("redis_lost").inc()
            await ctx.resubmit()
        elif await arequeue_stranded(ctx.aredis, ctx.job_id, ctx.queue):
            log.warning("job.stranded", extra={"job": ctx.job_id, "reason": "a worker popped it and died before starting it; queued again"})
            metrics.RESUBMITTED.labels("stranded").inc()
    except (redis.ConnectionError, redis.TimeoutError):
        pass  # Redis is away: the deadline still holds, and reading resumes when it is back


async def _cancel(ctx: RelayContext) -> None:
    try:
        await ctx.aredis.set(cancel_key(ctx.job_id), 1, ex=600)
    except redis.RedisError as e:
        log.warning("job.cancel_failed", extra={"job": ctx.job_id, "reason": str(e)})


def _count_done(r: JobResult, ctx: RelayContext) -> None:
    metrics.PROMPT_TOKENS.inc(r.usage.prompt_tokens)
    metrics.CACHED_TOKENS.labels("context").inc(r.usage.cached_from_context)
    metrics.CACHED_TOKENS.labels("store").inc(r.usage.cached_from_store)
    metrics.COMPLETION_TOKENS.inc(r.usage.completion_tokens)
    metrics.LATENCY.labels(ctx.endpoint).observe(time.perf_counter() - ctx.t0)
    ctx.job_seconds(r.timings.total_s)
