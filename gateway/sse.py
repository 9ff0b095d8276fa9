"""Server-sent events for the streaming APIs: the framing, and a response that closes its body when the client leaves.

OpenAI's streams are unnamed ``data: <json>`` events ending with ``data: [DONE]``;
Anthropic's Messages and OpenAI's Responses streams name each event (``event:
message_start``, ``event: response.output_text.delta``). `event` frames either kind, and
`EventStream` sends them, and, given a ``ping`` event, sends it whenever the stream
has been silent for ``ping_s`` seconds (Anthropic's streams carry ``ping`` events; a
client or a proxy that times out an idle stream would otherwise cut a long answer while a
worker evaluates a cold prompt).

The framing is written here rather than taken from sse-starlette: measured on this
gateway, sse-starlette's `EventSourceResponse` cost about twice the CPU per streamed
chunk of Starlette's `StreamingResponse` with these two functions (a cancel scope per
send, its own encoder), on the path every token takes; and importing it patches
uvicorn's exit handler so that a SIGTERM cuts open streams instead of letting them end.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from starlette.responses import ContentStream, StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
"""The last event of an OpenAI stream."""


def event(data: Any, name: str | None = None) -> bytes:
    """One event: ``data`` as JSON on one ``data:`` line (JSON has no raw line breaks), named by an ``event:`` line if given."""
    frame = b"data: " + json.dumps(data).encode() + b"\n\n"
    if name is None:
        return frame
    if "\n" in name or "\r" in name:
        raise ValueError(f"an event name is one line: {name!r}")
    return b"event: " + name.encode() + b"\n" + frame


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response that closes its body generator however the response ends.

    When the client goes away, Starlette stops iterating the body and leaves the generator
    to the garbage collector, so its ``finally`` (which cancels the job) could run seconds
    later, or never. Closing it here cancels the job as soon as the disconnect is seen.
    """

    media_type = "text/event-stream"

    def __init__(self, content: ContentStream, *, ping: bytes | None = None, ping_s: float = 0, **kwargs: Any) -> None:
        """``ping``: an event sent after each ``ping_s`` seconds in which nothing else was (0 or None: never)."""
        super().__init__(content, **kwargs)
        self.ping = ping if ping_s > 0 else None
        self.ping_s = ping_s

    async def stream_response(self, send: Send) -> None:
        if self.ping is None:
            return await super().stream_response(send)
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        lock = anyio.Lock()
        last = anyio.current_time()

        async def pings(ping: bytes) -> None:
            nonlocal last
            while True:
                await anyio.sleep(max(0.0, last + self.ping_s - anyio.current_time()))  # late on a busy loop: at once
                async with lock:
                    if anyio.current_time() - last >= self.ping_s:
                        try:
                            await send({"type": "http.response.body", "body": ping, "more_body": True})
                        except OSError:
                            return  # the client is gone: the body's next send says so
                        last = anyio.current_time()

        failed: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(pings, self.ping)
            try:
                async for chunk in self.body_iterator:
                    body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
                    async with lock:
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                        last = anyio.current_time()
            except Exception as e:  # raised as itself, not inside the task group's ExceptionGroup
                failed = e
            finally:
                tg.cancel_scope.cancel()
        if failed is not None:
            raise failed
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
