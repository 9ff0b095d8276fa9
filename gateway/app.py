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

import anyio
import redis
import redis.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from gateway.answer import sse, submit_all, whole
from gateway.batch_api import batch_router
from gateway.batch_service import BatchService
from gateway.batches import Batches
from gateway.dispatch import Dispatcher, mismatch
from gateway.errors import APIError, InvalidRequest, Overloaded
from gateway.files import Files
from gateway.middleware import BodyLimit, CountRequests
from gateway.prepare import Prepared, Preparer
from gateway.relay import RelayContext
from gateway.responses_api.routes import responses_router
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.settings import GatewaySettings
from gateway.tenants import Tenant, Tenants
from gateway.tokens_api import router as tokens_router
from store.backend import open_backend
from store.errors import StoreError
from worker.advert import adverts

log = logging.getLogger("kvpool.gateway")


class _ClosingStream(StreamingResponse):
    """A streaming response that closes its body generator however the response ends.

    When the client goes away, Starlette stops iterating the body and leaves the generator
    to the garbage collector, so its ``finally`` (which cancels the job) could run seconds
    later, or never. Closing it here cancels the job as soon as the disconnect is seen.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in err.get("loc", []) if p != "body"]
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    where = ".".join(loc)
    msg = err.get("msg", "invalid request")
    return (f"{where}: {msg}" if where else msg), (loc[0] if loc else None)


class Gateway:
    """The state one gateway process holds: settings, tokenizer, tenants, Redis, dispatcher."""

    def __init__(self, settings: GatewaySettings, model_path: Path) -> None:
        self.settings = settings
        self.preparer = Preparer(settings, model_path)
        self.tenants = Tenants(settings.api_keys, settings.tenant_secret)
        self.redis = redis.Redis.from_url(
            settings.redis_url, socket_connect_timeout=settings.connect_timeout_s, socket_timeout=settings.read_timeout_s
        )
        self.aredis = redis.asyncio.Redis.from_url(settings.redis_url, socket_connect_timeout=settings.connect_timeout_s)
        self.dispatcher = Dispatcher(self.redis, settings)

    async def answer(
        self, request: Request, prepared: list[Prepared], tenant: Tenant, *, stream: bool, include_usage: bool, want_logprobs: bool
    ) -> Response:
        jobs = await submit_all(self, prepared, tenant)
        if stream:
            return _ClosingStream(sse(self, request, jobs, include_usage, want_logprobs), media_type="text/event-stream")
        return JSONResponse(await whole(self, request, jobs, want_logprobs))

    def _relay_context(self, request: Request, prepared: Prepared, job_id: str, t0: float, endpoint: str) -> RelayContext:
        async def any_worker_alive() -> bool:
            return bool(await run_in_threadpool(adverts, self.redis))

        async def resubmit() -> None:
            await run_in_threadpool(self.dispatcher.requeue, prepared.spec, job_id)

        return RelayContext(
            request,
            self.aredis,
            job_id,
            t0,
            self.settings.request_timeout_s,
            endpoint,
            any_worker_alive,
            resubmit,
            self.dispatcher.job_time.observe,
        )

    def ready(self) -> dict[str, Any]:
        checks: dict[str, Any] = {}
        try:
            self.redis.ping()
            checks["redis"] = "ok"
        except redis.RedisError as e:
            checks["redis"] = f"unreachable: {e}"
        try:
            open_backend(self.settings).exists("readyz")
            checks["store"] = "ok"
        except StoreError as e:
            checks["store"] = str(e)
        try:
            live = adverts(self.redis)
            model, chunk = self.preparer.fingerprint, self.settings.chunk_size
            n = sum(a.serves(model, chunk) for a in live)
            checks["workers"] = n if n else (mismatch(live, model, chunk) if live else "no live worker")
            checks["layouts"] = sorted({a.layout for a in live if a.serves(model, chunk)})
        except redis.RedisError:
            checks["workers"] = "unknown (redis unreachable)"
        return checks


def create_app(settings: GatewaySettings, model_path: Path | None = None) -> FastAPI:
    """The ASGI app. ``model_path`` defaults to what the settings name (or the packaged SmolLM2)."""
    from worker.model_fetch import resolve_model

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
        await gw.aredis.aclose()

    app = FastAPI(title="kvpool", version="0.1.0", lifespan=lifespan, description="OpenAI-compatible API over a kvpool worker pool.")
    app.state.gateway = gw

    _add_error_handlers(app)

    async def tenant_of(request: Request) -> Tenant:
        return gw.tenants.resolve(request.headers.get("authorization"))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        tenant = await tenant_of(request)
        prepared = await run_in_threadpool(gw.preparer.completions, body, tenant)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await gw.answer(
            request, prepared, tenant, stream=body.stream, include_usage=include_usage, want_logprobs=body.logprobs is not None
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        tenant = await tenant_of(request)
        prepared = await run_in_threadpool(gw.preparer.chat, body, tenant)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await gw.answer(request, [prepared], tenant, stream=body.stream, include_usage=include_usage, want_logprobs=body.logprobs)

    _add_models_route(app, gw, tenant_of)
    _add_health_routes(app, gw, settings)
    app.include_router(tokens_router)
    app.include_router(responses_router(gw, tenant_of, _ClosingStream))
    if settings.batch_api:
        app.include_router(batch_router(settings, Files(lambda: open_backend(settings)), Batches(gw.redis), tenant_of))
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, paths={"/v1/files": settings.max_file_bytes})
    app.add_middleware(CountRequests)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure becomes one OpenAI-style error body, in this one place."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(e)
        return _error_response(InvalidRequest(message, param=param))

    @app.exception_handler(redis.RedisError)
    async def _redis_down(request: Request, e: redis.RedisError) -> JSONResponse:
        log.error("redis.unavailable", extra={"reason": str(e)})
        return _error_response(
            Overloaded(f"the job queue (Redis) is unreachable: {type(e).__name__}", code="queue_unavailable", headers={"Retry-After": "5"})
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("request.failed")
        return _error_response(APIError(f"internal error: {type(e).__name__}"))


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
        await tenant_of(request)
        return {"object": "list", "data": [{"id": gw.preparer.model_name, "object": "model", "created": 0, "owned_by": "kvpool"}]}
