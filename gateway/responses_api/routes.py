"""HTTP routes of the Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``, ``GET .../input_items``.

Each route resolves the caller's tenant first and sees only that tenant's responses
(`gateway.responses_api.state`): another tenant's id is a 404, and as a
``previous_response_id`` a 400 ``previous_response_not_found``, exactly as an id that
never existed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from gateway.errors import InvalidRequest
from gateway.idempotency import submit_once
from gateway.responses_api.prepare import prepare_turn
from gateway.responses_api.run import Run
from gateway.responses_api.schemas import ResponseCreate
from gateway.responses_api.state import ResponseState
from gateway.state import Gateway
from gateway.tenants import Tenant


def responses_router(
    gw: Gateway, tenant_of: Callable[[Request], Awaitable[Tenant]], streaming: type[StreamingResponse] = StreamingResponse
) -> APIRouter:
    """``streaming``: the response class of event streams (the app's closes its body as soon as the client leaves)."""
    state = ResponseState(gw.redis, gw.settings.responses_ttl_s, gw.settings.responses_max_bytes)
    router = APIRouter()

    @router.post("/v1/responses", response_model=None)
    async def create(body: ResponseCreate, request: Request) -> Response:
        tenant = await tenant_of(request)
        prev = None
        if body.previous_response_id is not None:
            prev = await run_in_threadpool(state.previous, tenant, body.previous_response_id)
        turn = await run_in_threadpool(prepare_turn, gw.preparer, body, tenant, prev)
        run = Run(gw, state, body, turn, tenant)
        [job] = await submit_once(gw, request, [turn.prepared], tenant)
        if body.stream:
            return streaming(run.sse(request, job), media_type="text/event-stream")
        return JSONResponse(await run.whole(request, job))

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request, stream: bool = False) -> dict[str, Any]:
        tenant = await tenant_of(request)
        if stream:
            raise InvalidRequest("replaying a stored response as a stream is not supported; retrieve it whole", param="stream")
        return (await run_in_threadpool(state.need, tenant, response_id)).response

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> dict[str, Any]:
        tenant = await tenant_of(request)
        await run_in_threadpool(state.delete, tenant, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str,
        request: Request,
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
        before: str | None = None,
    ) -> dict[str, Any]:
        tenant = await tenant_of(request)
        items = (await run_in_threadpool(state.need, tenant, response_id)).items
        return page(items[::-1] if order == "desc" else items, limit, after, before)

    return router


def page(items: list[dict[str, Any]], limit: int, after: str | None, before: str | None) -> dict[str, Any]:
    """One page of a cursor list, OpenAI's way: the items after ``after`` and before ``before``, at most ``limit``."""
    ids = [i["id"] for i in items]
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise InvalidRequest(f"{name}: no item with id {cursor!r} in this response's input", param=name)
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(items)
    chosen = items[start:end]
    data = chosen[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(chosen) > limit,
    }
