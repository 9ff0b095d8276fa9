"""The gateway's plain-ASGI middleware: every response is counted, 500s included; bodies over the limit are 413."""

from __future__ import annotations

import anyio
import pytest
from starlette.types import Message, Receive, Scope, Send

from gateway import metrics
from gateway.middleware import BodyLimit, CountRequests


def _count(path: str, status: str) -> float:
    return metrics.REQUESTS.labels(path, status)._value.get()


async def _call(app, body_parts: list[bytes], path: str = "/x") -> list[Message]:  # type: ignore[no-untyped-def]
    sent: list[Message] = []
    parts = list(body_parts)

    async def receive() -> Message:
        if parts:
            chunk = parts.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(parts)}
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app({"type": "http", "path": path, "headers": []}, receive, send)
    return sent


def test_an_unhandled_error_is_counted_as_a_500() -> None:
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("boom")

    before = _count("unmatched", "500")
    with pytest.raises(RuntimeError):
        anyio.run(_call, CountRequests(broken), [b""], "/boom")
    assert _count("unmatched", "500") == before + 1  # no route serves /boom: its label is no path


def test_a_chunked_body_over_the_limit_is_413_and_never_reaches_the_app() -> None:
    reached = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        reached.append(await receive())

    sent = anyio.run(_call, BodyLimit(app, 1024), [b"x" * 600, b"x" * 600])
    assert sent[0]["status"] == 413 and not reached


def test_the_app_gets_the_whole_body_at_once_and_then_the_disconnect() -> None:
    got: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        got.append(await receive())
        got.append(await receive())

    anyio.run(_call, BodyLimit(app, 1024), [b"ab", b"cd"])
    assert got[0] == {"type": "http.request", "body": b"abcd", "more_body": False}
    assert got[1]["type"] == "http.disconnect"
