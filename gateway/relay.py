"""Relaying one job's events to its HTTP client, whatever happens to the client, the worker or Redis.

`relay` yields the job's token events (each once, even when a retried attempt replays
them) and then its `JobResult` (`relay_reads` the tokens of each read of the stream together), or raises an `APIError` that names the failure. Every
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
import contextlib
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
from worker.client import Event, arequeue_stranded, job_key
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
class _Progress:
    """What the client was given: tokens by position, whichever attempt wrote them, and the attempt now writing."""

    worker: str | None = None
    attempt_tokens: int = 0
    """Tokens of the latest attempt (a retried attempt replays the positions the client already has)."""
    emitted: int = 0

    def take(self, batch: list[Event], ctx: RelayContext) -> tuple[list[TokenEvent], DoneEvent | ErrorEvent | None]:
        """The tokens of ``batch`` new to the client, and the job's last event if the batch holds it."""
        fresh: list[TokenEvent] = []
        for ev in batch:
            if isinstance(ev, StartEvent):
                self.worker, self.attempt_tokens = ev.worker, 0
            elif isinstance(ev, TokenEvent):
                self.attempt_tokens += 1
                if self.attempt_tokens > self.emitted:
                    self.emitted += 1
                    if self.emitted == 1:
                        metrics.FIRST_TOKEN.labels(ctx.endpoint).observe(time.perf_counter() - ctx.t0)
                    fresh.append(ev)
            elif isinstance(ev, DoneEvent) or (isinstance(ev, ErrorEvent) and not ev.retrying):
                return fresh, ev
        return fresh, None


async def relay(ctx: RelayContext) -> AsyncGenerator[TokenEvent | JobResult]:
    """`relay_reads`, a token at a time."""
    async with contextlib.aclosing(relay_reads(ctx)) as reads:
        async for item in reads:
            if isinstance(item, JobResult):
                yield item
            else:
                for token in item:
                    yield token


async def relay_reads(ctx: RelayContext) -> AsyncGenerator[list[TokenEvent] | JobResult]:
    """The job's new tokens of each read of its stream (a streamed response sends them in one write), then its result."""
    progress = _Progress()
    next_check = time.monotonic() + CHECK_S
    finished = False
    try:
        async with contextlib.aclosing(ctx.reader.batches(ctx.job_id)) as batches:
            async for batch in batches:
                if time.perf_counter() > ctx.t0 + ctx.timeout_s:
                    metrics.CANCELLED.labels("timeout").inc()
                    raise Timeout(f"no answer within {ctx.timeout_s:.0f} s; the job was cancelled", code="timeout")
                if batch is None or time.monotonic() > next_check:
                    next_check = time.monotonic() + CHECK_S
                    await _check(ctx, progress.worker)
                fresh, last = progress.take(batch or [], ctx)
                if fresh:
                    yield fresh
                if isinstance(last, ErrorEvent):
                    raise WorkerFailed(f"the worker failed: {last.error}", code="worker_error")
                if isinstance(last, DoneEvent):
                    _count_done(last.result, ctx)
                    finished = True
                    yield last.result
                    return
    finally:
        if not finished:
            with anyio.CancelScope(shield=True):
                await _cancel(ctx)


async def _check(ctx: RelayContext, worker: str | None) -> None:
    if await ctx.request.is_disconnected():
        metrics.CANCELLED.labels("client_gone").inc()
        raise asyncio.CancelledError
    try:
        if worker is not None and not await ais_live(ctx.aredis, worker):
            if not await ctx.any_worker_alive():
                raise WorkerFailed(f"worker {worker} died while answering and no other worker is alive", code="worker_lost")
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
