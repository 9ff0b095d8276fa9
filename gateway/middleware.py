"""ASGI middleware of the gateway: the body limit, and request counting and logging, written as plain ASGI.

Plain ASGI rather than Starlette's ``BaseHTTPMiddleware``: that one hides the client's
disconnect from the endpoint (so a non-streaming client that left could not cancel its
job) and never sees the 500s that the server-error handler answers outside it.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from starlette.requests import Request
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import metrics
from gateway.errors import APIError, PayloadTooLarge
from gateway.tenants import Tenant

log = logging.getLogger("kvpool.gateway")

ErrorShape = Callable[[APIError], dict[str, Any]]
"""An API's own error body (Anthropic's, for its routes); OpenAI's is the default."""


async def send_error(send: Send, e: APIError, shape: ErrorShape | None = None) -> None:
    body = json.dumps(shape(e) if shape else e.body()).encode()
    headers = [(b"content-type", b"application/json")] + [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Reads the whole body first and answers 413 once it passes the limit, announced or chunked.

    The endpoint then gets the body in one message; later ``receive`` calls reach the
    client's own, so a disconnect is still seen.
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, paths: dict[str, int] | None = None, shapes: Mapping[str, ErrorShape] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.paths = paths or {}
        """Other limits for the paths named (file uploads)."""
        self.shapes = shapes or {}
        """Error bodies for the paths under each prefix named."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        limit = self.paths.get(path, self.max_bytes)
        shape = next((f for prefix, f in self.shapes.items() if path.startswith(prefix)), None)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await send_error(send, PayloadTooLarge(f"request body of {int(declared)} bytes exceeds the limit of {limit}"), shape)
            return
        parts: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body was complete
            parts.append(message.get("body", b""))
            seen += len(parts[-1])
            if seen > limit:
                await send_error(send, PayloadTooLarge(f"request body exceeds the limit of {limit} bytes"), shape)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(parts), receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


REQUEST_ID = "x-request-id"
"""The response header naming the request (and its log lines)."""
MAX_ERROR_BODY = 64 * 1024
"""Most bytes of an error body read back for its log line."""


class CountRequests:
    """Counts every response by route and status (500s from unhandled errors included), and logs every refusal.

    The ``endpoint`` label is the route's template (``/v1/responses/{response_id}``), never
    the raw path, so a path that carries ids adds no series; a path no route serves is
    ``unmatched``. Every response gets an ``x-request-id``; a response of 400 or more
    writes one ``request.rejected`` line with it, the tenant (once known), the status,
    the error's type, the field it names and its message, so a client's failure can be
    read from the gateway's log.
    """

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute] = ()) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        request_id = "req_" + secrets.token_hex(12)
        error: list[bytes] = []

        async def counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (REQUEST_ID.encode(), request_id.encode())]}
            elif message["type"] == "http.response.body" and status >= 400 and sum(map(len, error)) < MAX_ERROR_BODY:
                error.append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting)
        finally:
            endpoint = self.endpoint(scope)
            metrics.REQUESTS.labels(endpoint, str(status)).inc()
            if status >= 400:
                log_rejected(scope, endpoint, status, request_id, b"".join(error))

    def endpoint(self, scope: Scope) -> str:
        """The template of the route that served the request (or would have: a body refused before routing)."""
        route = scope.get("route")
        if isinstance(getattr(route, "path", None), str):
            return str(route.path)  # type: ignore[union-attr]
        for r in self.routes:
            if r.matches(scope)[0] == Match.FULL and isinstance(getattr(r, "path", None), str):
                return str(r.path)  # type: ignore[attr-defined]
        return "unmatched"


def noted(request: Request, tenant: Tenant) -> Tenant:
    """``tenant``, noted on the request for the log line of a refusal that comes after it is known."""
    request.state.tenant = tenant.id
    return tenant


def log_rejected(scope: Scope, endpoint: str, status: int, request_id: str, body: bytes) -> None:
    """One line for a refused request: what a client needs to see why (its error's type, field and message)."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        doc = {}
    err = doc.get("error") if isinstance(doc, dict) else None
    err = err if isinstance(err, dict) else {}
    message = str(err.get("message") or err.get("detail") or "")
    head = message.split(":", 1)[0]
    field = head if ":" in message and head and " " not in head else err.get("param")  # the path the message names, else param
    state = scope.get("state") or {}
    extra = {
        "request_id": request_id,
        "tenant": state.get("tenant"),
        "method": scope.get("method"),
        "endpoint": endpoint,
        "status": status,
        "error_type": err.get("type"),
        "field": field,
        "reason": message[:300],
    }
    (log.warning if status < 500 else log.error)("request.rejected", extra=extra)
