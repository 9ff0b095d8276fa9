"""ASGI middleware of the gateway: the body limit and request counting, written as plain ASGI.

Plain ASGI rather than Starlette's ``BaseHTTPMiddleware``: that one hides the client's
disconnect from the endpoint (so a non-streaming client that left could not cancel its
job) and never sees the 500s that the server-error handler answers outside it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import metrics
from gateway.errors import APIError, PayloadTooLarge

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


class CountRequests:
    """Counts every response by path and status, 500s from unhandled errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting)
        finally:
            metrics.REQUESTS.labels(scope["path"], str(status)).inc()
