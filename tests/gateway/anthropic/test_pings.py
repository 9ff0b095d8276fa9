"""A streamed message that is silent for a while (waiting in the queue, or a long cold prompt) sends ``ping`` events, as Anthropic's do.

Clients and proxies time out a stream that sends nothing; here the request waits in the
queue of a pool scaled to zero, so the stream stays silent for as long as the test
wants, without depending on how fast anything runs.
"""

from __future__ import annotations

import queue
import threading

import httpx

from tests.helpers import MODEL

BODY = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hello"}]}
HEADERS = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}


def read_event_names(url: str, names: queue.Queue[str | None]) -> None:
    with httpx.stream("POST", url + "/v1/messages", json=BODY, headers=HEADERS, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.put(line.removeprefix("event: "))
    names.put(None)


def test_a_silent_stream_sends_pings_until_its_answer_comes(start_gateway, start_worker) -> None:
    gw = start_gateway(KVPOOL_QUEUE_WITHOUT_WORKERS="true", KVPOOL_STREAM_PING_S="0.2")
    names: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=read_event_names, args=(gw.url, names), daemon=True).start()
    seen: list[str | None] = []
    while seen.count("ping") < 4:  # the one after message_start, then three more while no worker takes the job
        seen.append(names.get(timeout=60))
    assert seen == ["message_start", "ping", "ping", "ping", "ping"]

    start_worker("w1")
    while seen[-1] is not None:
        seen.append(names.get(timeout=120))
    answer = [n for n in seen[5:-1] if n != "ping"]
    assert answer[-2:] == ["message_delta", "message_stop"] and "content_block_start" in answer


def test_pings_can_be_turned_off(start_gateway, start_worker) -> None:
    start_worker("w1")
    gw = start_gateway(KVPOOL_STREAM_PING_S="0")
    names: queue.Queue[str | None] = queue.Queue()
    read_event_names(gw.url, names)
    seen = list(iter(names.get_nowait, None))
    assert seen[:2] == ["message_start", "ping"] and seen.count("ping") == 1 and seen[-1] == "message_stop"
