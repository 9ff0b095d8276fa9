"""The routes: ``POST /v1/messages`` (whole or streamed) and ``POST /v1/messages/count_tokens``.

A message is one job of the chat pipeline: prepared here (`gateway.anthropic.prepare`),
admitted and routed like any other (`gateway.idempotency.submit_once`: an `Idempotency-Key` works here too), its events relayed
(`gateway.relay`) and written as Anthropic's message or events. The API key comes in
``x-api-key``, as Anthropic's clients send it, or in ``Authorization: Bearer``; either
names a tenant (`gateway.tenants`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import redis
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from gateway.answer import Submitted, cancel_unfinished
from gateway.anthropic.errors import AnthropicRoute, error_body
from gateway.anthropic.events import PING, MessageEvents, message_body, sse
from gateway.anthropic.prepare import MessageJob, count_tokens, prepare_message
from gateway.anthropic.schemas import CountTokensRequest, MessagesRequest
from gateway.errors import APIError, Overloaded, Unauthorized, WorkerFailed
from gateway.idempotency import submit_once
from gateway.middleware import noted
from gateway.relay import relay, relay_reads
from gateway.sse import EventStream
from gateway.state import Gateway
from gateway.tenants import Tenant
from worker.protocol import JobResult

log = logging.getLogger("kvpool.gateway")

ENDPOINT = "messages"


def messages_router(gw: Gateway) -> APIRouter:
    router = APIRouter(route_class=AnthropicRoute, tags=["Anthropic Messages"])

    def tenant_of(request: Request) -> Tenant:
        key = request.headers.get("x-api-key")
        auth = f"Bearer {key}" if key else request.headers.get("authorization")
        if auth is None and gw.tenants.api_keys:
            raise Unauthorized("missing API key: send 'x-api-key: <key>' (or 'Authorization: Bearer <key>')", code="invalid_api_key")
        return noted(request, gw.tenants.resolve(auth))

    @router.post("/v1/messages", response_model=None)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        tenant = tenant_of(request)
        job = await run_in_threadpool(prepare_message, gw.preparer, body, tenant)
        [sub] = await submit_once(gw, request, [job.prepared], tenant)
        if body.stream:
            return EventStream(_events(gw, request, sub, job), ping=PING, ping_s=gw.settings.stream_ping_s)
        return JSONResponse(await _whole(gw, request, sub, job))

    @router.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
        tenant_of(request)
        return {"input_tokens": await run_in_threadpool(count_tokens, gw.preparer, body)}

    return router


async def _whole(gw: Gateway, request: Request, sub: Submitted, job: MessageJob) -> dict[str, Any]:
    t0 = sub.t0
    try:
        async for ev in relay(gw.relay_context(request, sub.prepared, sub.job_id, t0, ENDPOINT)):
            if isinstance(ev, JobResult):
                sub.done = True
                return message_body(sub.job_id, gw.preparer.model_name, ev, job)
    finally:
        await cancel_unfinished(gw, [sub])
    raise WorkerFailed("the job ended without a result")


async def _events(gw: Gateway, request: Request, sub: Submitted, job: MessageJob) -> AsyncIterator[bytes]:
    t0 = sub.t0
    writer = MessageEvents(sub.job_id, gw.preparer.model_name, job)
    try:
        for chunk in writer.start():
            yield chunk
        reads = relay_reads(gw.relay_context(request, sub.prepared, sub.job_id, t0, ENDPOINT))
        try:
            async for got in reads:
                if isinstance(got, JobResult):
                    yield b"".join(writer.finish(got))
                    sub.done = True
                elif frames := b"".join(chunk for t in got for chunk in writer.token(t)):
                    yield frames  # the tokens of one read in one write to the socket
        finally:
            with anyio.CancelScope(shield=True):
                await reads.aclose()
    except APIError as e:
        log.warning("stream.failed", extra={"job": sub.job_id, "status": e.status, "reason": e.message})
        yield sse(error_body(e))
    except redis.RedisError as e:
        log.error("stream.failed", extra={"job": sub.job_id, "reason": f"{type(e).__name__}: {e}"})
        yield sse(error_body(Overloaded(f"the job queue (Redis) was lost mid-stream: {type(e).__name__}")))
    finally:
        await cancel_unfinished(gw, [sub])
