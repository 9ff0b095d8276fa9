"""Answering a request: its jobs (one, or one per prompt of a completion request) dispatched, relayed and shaped.

Every job of a request is admitted before any is relayed, so a request is refused whole
(503) rather than half answered; jobs already enqueued are then cancelled. Jobs run in
parallel on the pool and are relayed in prompt order; choice ``i`` of prompt ``p`` is
index ``p * n + i``, as in OpenAI's API. Whatever ends the request, every job not finished
is cancelled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import redis
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway import metrics
from gateway.errors import APIError, WorkerFailed, to_api_error
from gateway.prepare import Prepared
from gateway.relay import relay, relay_reads
from gateway.responses import StreamChunks, chat_body, completion_body, merged_extra, sum_usage
from gateway.sse import DONE, EventStream, event
from gateway.state import Gateway
from gateway.tenants import Tenant
from worker.protocol import JobResult, TokenEvent, cancel_key

log = logging.getLogger("kvpool.gateway")


@dataclass
class Submitted:
    prepared: Prepared
    job_id: str
    offset: int
    done: bool = False
    t0: float = field(default_factory=time.perf_counter)
    """When the request began to be submitted (`time.perf_counter`): its deadline counts from here, a wait for a starting pool included."""


async def submit_all(gw: Gateway, prepared: list[Prepared], tenant: Tenant, job_ids: list[str] | None = None) -> list[Submitted]:
    """Dispatch one job per prompt, under ``job_ids`` when given (an Idempotency-Key's claim names them first).

    A pool that is starting is waited for (`gateway.starting`), within the request's deadline.
    """
    jobs: list[Submitted] = []
    t0 = time.perf_counter()
    try:
        for i, p in enumerate(prepared):
            job_id, route = await gw.starting.dispatch(p.spec, job_ids[i] if job_ids else None, t0)
            jobs.append(Submitted(p, job_id, len(jobs) * p.spec.sampling.n, t0=t0))
            log.info(
                "request.routed",
                extra={
                    "job": job_id,
                    "tenant": tenant.id,
                    "queue": route.queue,
                    "reason": route.reason,
                    "prompt_tokens": len(p.spec.tokens),
                },
            )
    except BaseException:
        await cancel_unfinished(gw, jobs)
        raise
    metrics.TENANT_REQUESTS.labels(tenant.id).inc()
    return jobs


async def cancel_unfinished(gw: Gateway, jobs: list[Submitted]) -> None:
    with anyio.CancelScope(shield=True):
        for j in jobs:
            if not j.done:
                try:
                    await gw.aredis.set(cancel_key(j.job_id), 1, ex=600)
                except redis.RedisError as e:
                    log.warning("job.cancel_failed", extra={"job": j.job_id, "reason": str(e)})


def body_of(job: Submitted, model: str, result: JobResult, tokens: list[TokenEvent], want_logprobs: bool) -> dict[str, Any]:
    p = job.prepared
    if p.chat:
        return chat_body(job.job_id, model, result, tokens, want_logprobs, tools=p.tools)
    return completion_body(job.job_id, model, result, tokens, want_logprobs, echo=p.echo, offset=job.offset)


async def whole(gw: Gateway, request: Request, jobs: list[Submitted], want_logprobs: bool) -> dict[str, Any]:
    """The whole response: each job's events collected, its body built, the bodies merged."""
    t0, endpoint = jobs[0].t0, "chat" if jobs[0].prepared.chat else "completions"
    bodies: list[dict[str, Any]] = []
    results: list[JobResult] = []
    try:
        for job in jobs:
            tokens: list[TokenEvent] = []
            async for ev in relay(gw.relay_context(request, job.prepared, job.job_id, t0, endpoint)):
                if isinstance(ev, TokenEvent):
                    tokens.append(ev)
                elif isinstance(ev, JobResult):
                    job.done = True
                    results.append(ev)
                    bodies.append(body_of(job, gw.preparer.model_name, ev, tokens, want_logprobs))
            if not job.done:
                raise WorkerFailed("the job ended without a result")
    finally:
        await cancel_unfinished(gw, jobs)
    if len(bodies) == 1:
        return bodies[0]
    return {
        **bodies[0],
        "choices": [c for b in bodies for c in b["choices"]],
        "usage": sum_usage([b["usage"] for b in bodies]),
        "kvpool": merged_extra(results),
    }


async def sse(gw: Gateway, request: Request, jobs: list[Submitted], include_usage: bool, want_logprobs: bool) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed response: each job's chunks in turn, then usage, then ``[DONE]``."""
    t0, endpoint = jobs[0].t0, "chat" if jobs[0].prepared.chat else "completions"
    results: list[JobResult] = []
    chunks = None
    try:
        for job in jobs:
            p = job.prepared
            n = p.spec.sampling.n
            chunks = StreamChunks(
                jobs[0].job_id, gw.preparer.model_name, p.chat, want_logprobs, n, offset=job.offset, echo=p.echo, tools=p.tools
            )
            if (head := chunks.first()) is not None:
                yield event(head)
            reads = relay_reads(gw.relay_context(request, p, job.job_id, t0, endpoint))
            try:
                async for got in reads:
                    if isinstance(got, JobResult):
                        yield b"".join(event(chunk) for chunk in chunks.last(got))
                        job.done = True
                        results.append(got)
                    elif frames := b"".join(event(chunk) for t in got for chunk in chunks.token(t)):
                        yield frames  # the tokens of one read in one write to the socket
            finally:
                with anyio.CancelScope(shield=True):
                    await reads.aclose()
        if include_usage and chunks is not None:
            yield event(chunks.usage(results))
    except (APIError, redis.RedisError) as exc:  # the status line is sent: the error goes in the stream
        e = to_api_error(exc)
        level = logging.WARNING if e is exc else logging.ERROR  # the pool's answer, or Redis lost mid-stream
        log.log(level, "stream.failed", extra={"job": jobs[0].job_id, "status": e.status, "reason": f"{type(exc).__name__}: {exc}"})
        yield event(e.body())
    finally:
        await cancel_unfinished(gw, jobs)
    yield DONE


async def answer(
    gw: Gateway, request: Request, jobs: list[Submitted], *, stream: bool, include_usage: bool, want_logprobs: bool
) -> Response:
    """Answer with the jobs' events (`submit_all`'s, or `gateway.idempotency.submit_once`'s): an event stream, or one JSON body."""
    if stream:
        return EventStream(sse(gw, request, jobs, include_usage, want_logprobs))
    return JSONResponse(await whole(gw, request, jobs, want_logprobs))
