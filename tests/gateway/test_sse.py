"""Server-sent events as the official clients read them: OpenAI's unnamed ``data:`` events and Anthropic's named ones."""

from __future__ import annotations

import anthropic._streaming
import anyio
import openai._streaming
import pytest

from gateway.sse import DONE, EventStream, event


@pytest.mark.parametrize("decoder", [openai._streaming.SSEDecoder, anthropic._streaming.SSEDecoder], ids=["openai", "anthropic"])
def test_the_official_clients_read_each_event_whole(decoder) -> None:
    raw = event({"text": "a\nb", "n": 1}) + event({"type": "message_start"}, "message_start") + DONE
    got = [(e.event, e.json() if e.data != "[DONE]" else e.data) for e in decoder().iter_bytes(iter([raw]))]
    assert got == [(None, {"text": "a\nb", "n": 1}), ("message_start", {"type": "message_start"}), (None, "[DONE]")]


def test_an_event_name_is_one_line() -> None:
    with pytest.raises(ValueError, match="one line"):
        event({}, "message_start\ndata: forged")


def test_an_event_stream_is_served_as_text_event_stream() -> None:
    async def body():
        yield event({"n": 1})
        yield DONE

    sent = serve(EventStream(body()))
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert b"".join(m.get("body", b"") for m in sent[1:]) == b'data: {"n": 1}\n\ndata: [DONE]\n\n'


def test_a_stream_whose_event_loop_runs_late_still_pings_and_ends_whole() -> None:
    """On a loaded machine the loop wakes after a ping was due: the wait until the next one is then none, never negative."""
    import time

    async def body():
        time.sleep(0.05)  # the event loop is held past the first ping's time (a slow start: Redis, a busy CPU)
        await anyio.sleep(0.02)
        yield event({"n": 1})

    sent = serve(EventStream(body(), ping=b"event: ping\n\n", ping_s=0.005))
    bodies = [m.get("body", b"") for m in sent[1:]]
    assert b"event: ping\n\n" in bodies and bodies[-2:] == [b'data: {"n": 1}\n\n', b""]
    assert sent[-1]["more_body"] is False


def serve(stream: EventStream) -> list[dict]:
    """Run ``stream`` as an ASGI app for one request whose client never leaves; the messages it sent."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await anyio.sleep_forever()
        return {}

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/", "headers": []}
    anyio.run(stream, scope, receive, send)
    return sent
