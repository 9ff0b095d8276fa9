"""Anthropic Messages responses: the whole message, and the server-sent events of a streamed one.

A stream goes ``message_start``, ``ping``, then for each content block
``content_block_start``, its deltas (``text_delta``, or one ``input_json_delta`` holding a
tool call's whole input) and ``content_block_stop``, then ``message_delta`` (stop reason,
and the final usage: ``message_start`` cannot know yet what the worker reuses) and
``message_stop``. ``message_start``'s usage counts no input: Anthropic's ``input_tokens`` is
the part read from no cache, which only the worker knows, and agents add that field of
``message_start`` to their totals unless ``message_delta`` replaces it with a positive
count (a prompt read whole from cache has none). Tool calls are found in the text as it streams (`gateway.tools`); text
that could open a call is held back until it is clearly not one.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.anthropic.prepare import MessageJob, stop_reason, usage
from gateway.responses import kvpool_extra
from gateway.sse import event
from gateway.tools import ToolStream
from worker.protocol import JobResult, TokenEvent


def message_id(job_id: str) -> str:
    return f"msg_{job_id}"


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-style call as a ``tool_use`` block: an ``toolu_`` id, its arguments as the ``input`` object."""
    try:
        args = json.loads(call["function"]["arguments"])
    except (json.JSONDecodeError, RecursionError):
        args = {}  # arguments an answer cut short left unfinished (its stop_reason says max_tokens)
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": args if isinstance(args, dict) else {"arguments": args},
    }


def content_of(text: str, job: MessageJob) -> list[dict[str, Any]]:
    """The answer's blocks in the order it wrote them: its text, and the tool calls found in it."""
    offered = job.prepared.tools
    if offered is None:
        return [{"type": "text", "text": text}] if text else []
    stream = offered.stream()
    blocks: list[dict[str, Any]] = []
    for d in stream.push(text) + stream.flush():
        if "content" in d and blocks and blocks[-1]["type"] == "text":
            blocks[-1]["text"] += d["content"]
        elif "content" in d:
            blocks.append({"type": "text", "text": d["content"]})
        elif "id" in d["tool_calls"][0]:
            blocks.append(tool_use(stream.calls[d["tool_calls"][0]["index"]]))
    return blocks


def message_body(job_id: str, model: str, result: JobResult, job: MessageJob) -> dict[str, Any]:
    content = content_of(result.text, job)
    reason, sequence = stop_reason(result, job, any(b["type"] == "tool_use" for b in content))
    return {
        "id": message_id(job_id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(result, job),
        "kvpool": kvpool_extra(result),
    }


def sse(ev: dict[str, Any]) -> bytes:
    """An Anthropic event, named by its type (framed by `gateway.sse.event`)."""
    return event(ev, ev["type"])


PING = sse({"type": "ping"})


class MessageEvents:
    """The events of one streamed message, in order: `start`, `token` for each token event, `finish` with the result."""

    def __init__(self, job_id: str, model: str, job: MessageJob) -> None:
        self.job_id = job_id
        self.model = model
        self.job = job
        self.tools: ToolStream | None = job.prepared.tools.stream() if job.prepared.tools else None
        self.index = -1
        self.open: str | None = None
        """The type of the content block open now."""
        self.called = False

    def start(self) -> list[bytes]:
        message: dict[str, Any] = {
            "id": message_id(self.job_id),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
        }
        return [sse({"type": "message_start", "message": message}), PING]

    def token(self, t: TokenEvent) -> list[bytes]:
        if not t.text:
            return []
        return self._deltas(self.tools.push(t.text) if self.tools else [{"content": t.text}])

    def finish(self, result: JobResult) -> list[bytes]:
        out = self._deltas(self.tools.flush()) if self.tools else []
        out += self._close()
        reason, sequence = stop_reason(result, self.job, self.called)
        u = usage(result, self.job)
        delta_usage = {k: u[k] for k in ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")}
        out.append(sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": delta_usage}))
        return [*out, sse({"type": "message_stop"})]

    def _deltas(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        out: list[bytes] = []
        for d in deltas:
            if "content" in d:
                if self.open != "text":
                    out += self._open({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d["content"]}))
                continue
            call = d["tool_calls"][0]
            if "id" in call:  # a call's head (id and name); its arguments come next, whole
                self.called = True
                block = tool_use({**call, "function": {**call["function"], "arguments": "{}"}})
                out += self._open(block)
            else:
                written = call["function"]["arguments"]
                args = tool_use({"id": "", "function": {"name": "", "arguments": written}})["input"]
                partial = json.dumps(args, ensure_ascii=False) if args or written.strip() in ("{}", "") else written  # cut: as written
                out.append(self._delta({"type": "input_json_delta", "partial_json": partial}))
        return out

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return [*out, sse({"type": "content_block_start", "index": self.index, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta})
