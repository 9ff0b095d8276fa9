"""HTTP routes of the OpenAI Files and Batch APIs: ``/v1/files`` and ``/v1/batches``.

Each route resolves the caller's tenant first and sees only that tenant's files and
batches (`gateway.batch.files`, `gateway.batch.records`); the batches themselves are run by the
gateways' `gateway.batch.service.BatchService`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, File, Form, Query, Request, Response, UploadFile
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from gateway.batch.files import UPLOAD_PURPOSES, Files, check_jsonl
from gateway.batch.records import Batches, public
from gateway.errors import InvalidRequest
from gateway.settings import GatewaySettings
from gateway.tenants import Tenant


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def batch_router(settings: GatewaySettings, files: Files, batches: Batches, tenant_of: Callable[[Request], Awaitable[Tenant]]) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/files")
    async def upload(request: Request, file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:
        tenant = await tenant_of(request)
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequest(f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}", param="purpose")
        data = await file.read()
        check_jsonl(data, settings.batch_max_requests)
        meta = await run_in_threadpool(files.create, tenant, file.filename or "upload.jsonl", purpose, data)
        return meta.body()

    @router.get("/v1/files/{file_id}")
    async def file_info(file_id: str, request: Request) -> dict[str, Any]:
        tenant = await tenant_of(request)
        return (await run_in_threadpool(files.get, tenant, file_id)).body()

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request) -> Response:
        tenant = await tenant_of(request)
        return Response(await run_in_threadpool(files.content, tenant, file_id), media_type="application/jsonl")

    @router.post("/v1/batches")
    async def create(body: BatchCreate, request: Request) -> dict[str, Any]:
        tenant = await tenant_of(request)
        await run_in_threadpool(files.get, tenant, body.input_file_id)
        rec = await run_in_threadpool(batches.create, tenant, body.input_file_id, body.endpoint, body.completion_window, body.metadata)
        return public(rec)

    @router.get("/v1/batches/{batch_id}")
    async def retrieve(batch_id: str, request: Request) -> dict[str, Any]:
        tenant = await tenant_of(request)
        return public(await run_in_threadpool(batches.get, tenant, batch_id))

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request) -> dict[str, Any]:
        tenant = await tenant_of(request)
        return public(await run_in_threadpool(batches.cancel, tenant, batch_id))

    @router.get("/v1/batches")
    async def listing(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None) -> dict[str, Any]:
        tenant = await tenant_of(request)
        recs, more = await run_in_threadpool(batches.list, tenant, limit, after)
        data = [public(r) for r in recs]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }

    return router
