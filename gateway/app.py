"""The OpenAI-compatible HTTP API. `create_app(settings)` builds it; ``kvpool gateway`` serves it with uvicorn.

The gateway never evaluates a model: it tokenizes (a vocabulary-only load), hashes the
chain, routes, enqueues, and relays the job's events as a response or a server-sent
event stream. Every failure is answered in OpenAI's error shape (`gateway.errors`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from gateway.answer import answer
from gateway.anthropic import error_body as anthropic_error_body
from gateway.anthropic import messages_router
from gateway.batch.api import batch_router
from gateway.batch.files import Files
from gateway.batch.records import Batches
from gateway.batch.service import BatchService
from gateway.errors import APIError, internal_error, to_api_error
from gateway.idempotency import submit_once
from gateway.middleware import BodyLimit, CountRequests, noted
from gateway.responses_api.routes import responses_router
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.settings import GatewaySettings
from gateway.sse import EventStream
from gateway.state import Gateway
from gateway.tenants import Tenant
from gateway.tokens_api import router as tokens_router
from store.backends import open_backend
from store.errors import StoreUnavailable

log = logging.getLogger("kvpool.gateway")

ERROR_SHAPES = {"/v1/messages": anthropic_error_body}
"""The routes that answer in another API's error shape than OpenAI's (the body limit answers before any route)."""


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(settings: GatewaySettings, model_path: Path | None = None) -> FastAPI:
    """The ASGI app. ``model_path`` defaults to what the settings name (or the packaged SmolLM2)."""
    from worker.models.fetch import resolve_model

    gw = Gateway(settings, model_path or resolve_model(settings))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        log.info(
            "gateway.ready",
            extra={
                "model": gw.preparer.model_name,
                "chunk_size": settings.chunk_size,
                "tenants": len(set(settings.api_keys.values())) or 1,
            },
        )
        checks = await run_in_threadpool(gw.ready)
        if isinstance(checks["workers"], str) and "serve" in checks["workers"]:
            log.warning("gateway.workers_mismatch", extra={"reason": checks["workers"]})
        service = _batch_service(settings, gw)
        yield
        if service is not None:
            await run_in_threadpool(service.stop)
        await gw.reader.close()
        await gw.aredis.aclose()  # type: ignore[attr-defined]  # redis-py 5's aclose(); the types-redis stubs predate it

    app = FastAPI(title="kvpool", version="0.1.0", lifespan=lifespan, description="OpenAI-compatible API over a kvpool worker pool.")
    app.state.gateway = gw

    _add_error_handlers(app)

    async def tenant_of(request: Request) -> Tenant:
        return noted(request, gw.tenants.resolve(request.headers.get("authorization")))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        tenant = await tenant_of(request)
        prepared = await run_in_threadpool(gw.preparer.completions, body, tenant)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        jobs = await submit_once(gw, request, prepared, tenant)
        return await answer(gw, request, jobs, stream=body.stream, include_usage=include_usage, want_logprobs=body.logprobs is not None)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        tenant = await tenant_of(request)
        prepared = await run_in_threadpool(gw.preparer.chat, body, tenant)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        jobs = await submit_once(gw, request, [prepared], tenant)
        return await answer(gw, request, jobs, stream=body.stream, include_usage=include_usage, want_logprobs=body.logprobs)

    _add_models_route(app, gw, tenant_of)
    _add_health_routes(app, gw, settings)
    app.include_router(tokens_router)
    app.include_router(messages_router(gw))
    app.include_router(responses_router(gw, tenant_of, EventStream))
    if settings.batch_api:
        app.include_router(batch_router(settings, Files(lambda: open_backend(settings)), Batches(gw.redis), tenant_of))
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, paths={"/v1/files": settings.max_file_bytes}, shapes=ERROR_SHAPES)
    app.add_middleware(CountRequests, routes=app.router.routes)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure becomes one OpenAI-style error body, through `gateway.errors.to_api_error`.

    A bare pydantic ValidationError is not among the mapped ones here: FastAPI raises its
    RequestValidationError for a bad request, so any other is the pool's own data failing
    to parse, a 500 like every exception the mapping does not know.
    """

    async def mapped(request: Request, e: Exception) -> JSONResponse:
        err = to_api_error(e)
        if err is not e and err.status >= 500:
            log.error("request.unavailable", extra={"code": err.code, "reason": f"{type(e).__name__}: {e}"})
        return _error_response(err)

    for kind in (APIError, RequestValidationError, StoreUnavailable, redis.RedisError):
        app.add_exception_handler(kind, mapped)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("request.failed")
        return _error_response(internal_error(e))


def _add_health_routes(app: FastAPI, gw: Gateway, settings: GatewaySettings) -> None:
    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        checks = await run_in_threadpool(gw.ready)
        workers_ok = isinstance(checks["workers"], int) or settings.queue_without_workers  # scaled to zero: requests wait in the queue
        ok = checks["redis"] == "ok" and checks["store"] == "ok" and workers_ok
        return JSONResponse({"status": "ready" if ok else "not ready", "checks": checks}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def _batch_service(settings: GatewaySettings, gw: Gateway) -> BatchService | None:
    """The thread that runs Batch API batches, with a Redis client whose reads outlast the runner's blocking polls."""
    if not settings.batch_api:
        return None
    conn = redis.Redis.from_url(
        settings.redis_url, socket_connect_timeout=settings.connect_timeout_s, socket_timeout=settings.read_timeout_s + 1
    )
    service = BatchService(settings, gw.preparer, Files(lambda: open_backend(settings)), conn)
    service.start()
    return service


def _add_models_route(app: FastAPI, gw: Gateway, tenant_of: Callable[[Request], Awaitable[Tenant]]) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        """The model, once a worker can take a job: until then 503, as llama-server while its model loads (`gateway.starting`)."""
        await tenant_of(request)
        if (unavailable := await gw.starting.models_unavailable()) is not None:
            raise unavailable
        return {"object": "list", "data": [{"id": gw.preparer.model_name, "object": "model", "created": 0, "owned_by": "kvpool"}]}
