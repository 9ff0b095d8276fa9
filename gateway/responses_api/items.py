"""Items: the Responses API's unit of conversation, as stored, as chat messages, and as the answer streams out.

A conversation is a list of public items (what ``GET /v1/responses/{id}/input_items``
returns): ``message`` items with ``input_text`` (or, said by the assistant,
``output_text``) parts, ``function_call`` items and ``function_call_output`` items. The
chat template renders chat messages, so `chat_messages` maps items onto them: a function
call joins the assistant message before it (its ``tool_calls``), an output becomes a
``tool`` message.

`OutputBuilder` turns the answer's text, as it streams, into output items and the events
that announce them, the same way whether the client streams or not; text inside
the calls the tool format writes (`gateway.toolformat.Offered`) become ``function_call`` items.
"""

from __future__ import annotations

import secrets
from typing import Any

from gateway.errors import InvalidRequest
from gateway.responses_api.schemas import FunctionCallItem, FunctionCallOutputItem, Item, MessageItem
from gateway.toolformat import Offered


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def public_item(item: Item) -> dict[str, Any]:
    """An input item as stored and listed: with an id, its text in parts, status ``completed``."""
    if isinstance(item, MessageItem):
        kind = "output_text" if item.role == "assistant" else "input_text"
        part: dict[str, Any] = {"type": kind, "text": item.text()}
        if kind == "output_text":
            part["annotations"] = []
        return {"id": item.id or new_id("msg"), "type": "message", "role": item.role, "content": [part], "status": "completed"}
    if isinstance(item, FunctionCallItem):
        call = {
            "id": item.id or new_id("fc"),
            "type": "function_call",
            "call_id": item.call_id,
            "name": item.name,
            "arguments": item.arguments,
            "status": "completed",
        }
        return {**call, "namespace": item.namespace} if item.namespace else call
    assert isinstance(item, FunctionCallOutputItem)
    out = {
        "id": item.id or new_id("fco"),
        "type": "function_call_output",
        "call_id": item.call_id,
        "output": item.text(),
        "status": "completed",
    }
    return out if item.call_id else {**out, "name": item.name, "namespace": item.namespace}  # to be matched (`resolve_outputs`)


def resolve_outputs(history: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
    """Give each output of ``new`` sent without a ``call_id`` (as Codex sends some) the call it answers.

    That is the latest call not yet answered to the function it names (in its namespace,
    when it names one), else the latest call not yet answered; with none, it is a 400 naming it.
    """
    open_calls: list[dict[str, Any]] = []
    for n, item in enumerate(history + new):
        if item["type"] == "function_call":
            open_calls.append(item)
        elif item["type"] == "function_call_output" and item.get("call_id"):
            open_calls = [c for c in open_calls if c["call_id"] != item["call_id"]]
        elif item["type"] == "function_call_output":
            name, namespace = item.pop("name", None), item.pop("namespace", None)
            named = [c for c in open_calls if c["name"] == name and (namespace is None or c.get("namespace") == namespace)]
            if not (named or open_calls):
                raise InvalidRequest(
                    f"input.{n - len(history)}.call_id: Field required (no function_call before this output is left to answer)",
                    param="input",
                )
            call = (named or open_calls)[-1]
            item["call_id"] = call["call_id"]
            open_calls.remove(call)


def _text(item: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in item.get("content", []))


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Public items as chat messages (`gateway.schemas.Message` fields)."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            out.append({"role": item["role"], "content": _text(item)})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [*(out[-1].get("tool_calls") or []), call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return out


def output_text(output: list[dict[str, Any]]) -> str:
    return "".join(_text(i) for i in output if i["type"] == "message")


class OutputBuilder:
    """The answer's output items, built as its text streams in, and the events (without sequence numbers) that announce them."""

    def __init__(self, tools: Offered | None, namespaces: dict[str, str] | None = None) -> None:
        self.items: list[dict[str, Any]] = []
        self._tools = tools.stream() if tools else None
        self._namespaces = namespaces or {}
        """The namespace tool of each function that came in one: its calls name it, as Codex expects."""
        self._open: dict[str, Any] | None = None

    def push(self, text: str) -> list[dict[str, Any]]:
        if self._tools is None:
            return self._text(text) if text else []
        return self._deltas(self._tools.push(text))

    def finish(self, status: str) -> list[dict[str, Any]]:
        """The end of the answer: what was held back, then every open item closed with ``status``.

        A call the held-back text ends with is the item the cut fell in when the answer was
        cut (``status`` ``incomplete``), as an open message is; the calls before it are whole.
        """
        held = self._tools.flush() if self._tools is not None else []
        events = self._deltas(held[:-1]) + self._deltas(held[-1:], status)
        if not self.items:
            events += self._open_message()
        return events + self._close(status)

    def _deltas(self, deltas: list[dict[str, Any]], status: str = "completed") -> list[dict[str, Any]]:
        """Events for the tool stream's deltas; a call they finish gets ``status``."""
        events: list[dict[str, Any]] = []
        for d in deltas:
            if "content" in d:
                events += self._text(d["content"])
                continue
            for call in d["tool_calls"]:
                if "id" in call:
                    events += self._close("completed") + self._call_added(call)
                else:
                    events += self._call_done(call["function"]["arguments"], status)
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": len(self.items) - 1}

    def _open_message(self) -> list[dict[str, Any]]:
        item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        self.items.append(item)
        self._open = item
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": {**item, "content": []}},
            {"type": "response.content_part.added", **self._where(item), "content_index": 0, "part": part},
        ]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = self._open_message() if self._open is None else []
        assert self._open is not None
        if not self._open["content"]:
            self._open["content"].append({"type": "output_text", "text": "", "annotations": []})
        self._open["content"][0]["text"] += text
        return [
            *events,
            {"type": "response.output_text.delta", **self._where(self._open), "content_index": 0, "delta": text, "logprobs": []},
        ]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        if not item["content"]:
            item["content"].append({"type": "output_text", "text": "", "annotations": []})
        part = item["content"][0]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        return [
            {"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"], "logprobs": []},
            {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": _copy(item)},
        ]

    def _call_added(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": "",
        }
        if call["function"]["name"] in self._namespaces:
            item["namespace"] = self._namespaces[call["function"]["name"]]
        self.items.append(item)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)}]

    def _call_done(self, arguments: str, status: str) -> list[dict[str, Any]]:
        item = self.items[-1]
        item["arguments"], item["status"] = arguments, status
        where = self._where(item)
        return [
            {"type": "response.function_call_arguments.delta", **where, "delta": arguments},
            {"type": "response.function_call_arguments.done", **where, "arguments": arguments},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": dict(item)},
        ]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(p) for p in item["content"]]}
