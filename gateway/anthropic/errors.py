"""Anthropic's error shape for the Messages routes: ``{"type": "error", "error": {"type": ..., "message": ...}}``.

The routes raise kvpool's own errors (`gateway.errors`); `AnthropicRoute` answers each,
and every validation error, in Anthropic's shape and status codes (an overloaded pool is
529 ``overloaded_error``), so the rest of the API keeps OpenAI's. The body limit, which
answers before any route, takes the shape from `error_body` too (`gateway.middleware`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

import redis
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import APIError, InvalidRequest, Overloaded

log = logging.getLogger("kvpool.gateway")

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
STATUS = {503: 529}
"""Anthropic answers an overloaded API with 529."""
UNION_TAGS = frozenset({"text", "tool_use", "tool_result", "thinking", "redacted_thinking", "auto", "any", "tool", "none"})


def error_body(e: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": TYPES.get(e.status, "api_error"), "message": e.message}}


def error_status(e: APIError) -> int:
    return STATUS.get(e.status, e.status)


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=error_status(e), headers=e.headers)


def validation_message(exc: RequestValidationError) -> str:
    """The deepest error (of a union's, the member that came furthest), with the path of the field it names.

    Such as ``messages.0.content.1.tool_use_id: Field required``.
    """
    err: dict[str, Any] = max(exc.errors(), key=lambda e: len(e.get("loc", ())), default={})
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON"
    loc = list(err.get("loc", []))
    path: list[str] = []
    for i, p in enumerate(loc):
        before = loc[i - 1] if i else None
        tag = p in UNION_TAGS and i + 1 < len(loc) and (isinstance(before, int) or before == "tool_choice")  # chose a block's kind
        member = isinstance(p, str) and ("[" in p or p[:1].isupper() or p in ("str", "int", "float", "bool"))  # of a union
        if not (tag or member or (p == "body" and i == 0)):
            path.append(str(p))
    msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
    return f"{'.'.join(path)}: {msg}" if path else msg


class AnthropicRoute(APIRoute):
    """A route whose every failure is answered in Anthropic's error shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return error_response(InvalidRequest(validation_message(e)))
            except APIError as e:
                return error_response(e)
            except redis.RedisError as e:
                log.error("redis.unavailable", extra={"reason": str(e)})
                return error_response(Overloaded(f"the job queue (Redis) is unreachable: {type(e).__name__}", headers={"Retry-After": "5"}))
            except Exception as e:
                log.exception("request.failed")
                return error_response(APIError(f"internal error: {type(e).__name__}"))

        return route
