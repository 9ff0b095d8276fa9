"""From an Anthropic Messages request to the chat pipeline's request, and where its ``cache_control`` marks fall.

The messages become OpenAI-style chat messages, which the chat template renders as for
``/v1/chat/completions`` (`gateway.prepare`):

* ``system`` (a string or text blocks) and ``system`` messages: a system message; Claude
  Code's billing header (a block, or a line, starting ``x-anthropic-billing-header:``) is
  left out, so its sessions share their prefix;
* text blocks: the message's text (several are joined by a newline);
* ``tool_use`` blocks: the assistant message's ``tool_calls``; ``tool_result`` blocks: ``tool``
  messages, in their place among the user's text, each answering a ``tool_use`` of an
  earlier message (one that answers none is refused);
* ``thinking`` blocks: dropped; blocks of a kind a text model cannot read: refused by name;
* consecutive messages of one role: one turn, as in Anthropic's API;
* a last ``assistant`` message of text only: the start of the answer (prefill).

Each ``cache_control`` mark (on a tool, a system block, a message block, or the request
itself, which marks its last block) becomes a `Mark`: the request cut just after the
marked block. Rendered, its tokens share a prefix with the whole prompt's; that prefix is
what is kept (`gateway.anthropic.prepare`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from gateway.anthropic.schemas import (
    MAX_CACHE_CONTROLS,
    TTL_S,
    CacheControl,
    ContentBlock,
    CountTokensRequest,
    MessagesRequest,
    OtherBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.errors import InvalidRequest
from gateway.schemas import ChatCompletionRequest

Located = tuple[str, ContentBlock]
"""A block and where the request holds it (``messages.2.content.0``), for error messages."""


@dataclass(frozen=True)
class Mark:
    """The request cut just after a block marked with ``cache_control``."""

    messages: list[dict[str, Any]]
    tools: int
    """How many of the request's tools come before the mark."""
    ttl_s: int


@dataclass
class Converted:
    messages: list[dict[str, Any]]
    prefill: str = ""
    marks: list[Mark] = field(default_factory=list)


def convert(req: CountTokensRequest) -> Converted:
    """The request's chat messages, its prefill and its marks. Raises `InvalidRequest` naming the field."""
    _check(req)
    n_tools = len(req.tools or [])
    system, marks = _system(req)
    marks += [Mark(list(system), i + 1, _ttl(t.cache_control)) for i, t in enumerate(req.tools or []) if t.cache_control and system]
    turns = _turns(req)
    prefill = ""
    if turns and turns[-1][0] == "assistant" and all(isinstance(b, TextBlock | ThinkingBlock) for _, b in turns[-1][1]):
        prefill = "\n".join(b.text for _, b in turns.pop()[1] if isinstance(b, TextBlock))
    done, seen = list(system), set[str]()
    for role, blocks in turns:
        for k, (_, block) in enumerate(blocks):
            if block.cache_control is not None:
                marks.append(Mark(done + _turn(role, blocks[: k + 1], set(seen)), n_tools, _ttl(block.cache_control)))
        done += _turn(role, blocks, seen)
    if req.cache_control is not None:
        marks.append(Mark(list(done), n_tools, _ttl(req.cache_control)))
    if not done:
        raise InvalidRequest("messages: the request holds no message to answer (only an assistant prefill)", param="messages")
    return Converted(done, prefill, [m for m in marks if m.messages])


def _ttl(cc: CacheControl | None) -> int:
    return TTL_S[cc.ttl if cc else "5m"]


def _check(req: CountTokensRequest) -> None:
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            raise InvalidRequest(
                f"tools.{i}.type: server tools ({t.type!r}) are not supported; kvpool serves client tools (type 'custom')", param="tools"
            )
        if t.input_schema is None:
            raise InvalidRequest(f"tools.{i}.input_schema: Field required", param="tools")
    blocks = [b for m in req.messages if isinstance(m.content, list) for b in m.content]
    system = req.system if isinstance(req.system, list) else []
    marked = [x for x in [*(req.tools or []), *system, *blocks, req] if x.cache_control is not None]
    if len(marked) > MAX_CACHE_CONTROLS:
        raise InvalidRequest(
            f"cache_control: a request may mark at most {MAX_CACHE_CONTROLS} blocks, this one marks {len(marked)}", param="cache_control"
        )


BILLING_HEADER = "x-anthropic-billing-header:"
"""What starts the system block (or line) Claude Code sends for Anthropic's billing: a version, an entry point and a hash
that changes with the first prompt (or every request). It is no part of the prompt: kept, it would part every session's
prefix from every other's at its first tokens."""


def _system(req: CountTokensRequest) -> tuple[list[dict[str, Any]], list[Mark]]:
    """The system message (without Claude Code's billing header, `BILLING_HEADER`) and the marks on its blocks."""
    if isinstance(req.system, str):
        text = "\n".join(line for line in req.system.split("\n") if not line.startswith(BILLING_HEADER))
        return ([{"role": "system", "content": text}] if text else []), []
    blocks = [b for b in req.system or [] if not b.text.startswith(BILLING_HEADER)]
    if not blocks:
        return [], []
    n_tools = len(req.tools or [])
    texts = [b.text for b in blocks]
    marks = [
        Mark([{"role": "system", "content": "\n".join(texts[: i + 1])}], n_tools, _ttl(b.cache_control))
        for i, b in enumerate(blocks)
        if b.cache_control is not None
    ]
    return [{"role": "system", "content": "\n".join(texts)}], marks


def _turns(req: CountTokensRequest) -> list[tuple[str, list[Located]]]:
    """The messages as turns: consecutive messages of one role joined, each block with its place in the request."""
    turns: list[tuple[str, list[Located]]] = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            blocks: list[Located] = [(f"messages.{i}.content", TextBlock(type="text", text=m.content))]
        elif not m.content:
            raise InvalidRequest(f"messages.{i}.content: a message needs at least one content block", param="messages")
        else:
            blocks = [(f"messages.{i}.content.{j}", b) for j, b in enumerate(m.content)]
        if turns and turns[-1][0] == m.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((m.role, blocks))
    return turns


def _turn(role: str, blocks: Sequence[Located], seen: set[str]) -> list[dict[str, Any]]:
    """One turn's chat messages; ``seen``: the ids of the tool_use blocks so far (this turn's are added)."""
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for where, b in blocks:
        if isinstance(b, ThinkingBlock):
            continue
        if isinstance(b, OtherBlock):
            raise InvalidRequest(f"{where}.type: '{b.type}' blocks are not supported: kvpool serves a text-only model", param="messages")
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ToolUseBlock):
            if role != "assistant":
                raise InvalidRequest(f"{where}: a tool_use block belongs in an assistant message", param="messages")
            seen.add(b.id)
            arguments = json.dumps(b.input, ensure_ascii=False)
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": arguments}})
        elif isinstance(b, ToolResultBlock):
            out += _result(role, where, b, seen, text)
            text = []
    if role == "assistant":
        out.append({"role": "assistant", "content": "\n".join(text) or None, "tool_calls": calls or None})
    elif text or not out:
        out.append({"role": role, "content": "\n".join(text)})
    return out


def _result(role: str, where: str, b: ToolResultBlock, seen: set[str], text: list[str]) -> list[dict[str, Any]]:
    """A tool_result as a ``tool`` message, after the user text that came before it."""
    if role != "user":
        raise InvalidRequest(f"{where}: a tool_result block belongs in a user message", param="messages")
    if b.tool_use_id not in seen:
        raise InvalidRequest(
            f"{where}.tool_use_id: {b.tool_use_id!r} answers no tool_use block of an earlier assistant message", param="messages"
        )
    if isinstance(b.content, str):
        content = b.content
    else:
        for j, part in enumerate(b.content):
            if isinstance(part, OtherBlock):
                raise InvalidRequest(
                    f"{where}.content.{j}.type: '{part.type}' is not supported in a tool result (text only)", param="messages"
                )
        content = "\n".join(p.text for p in b.content if not isinstance(p, OtherBlock))
    before = [{"role": "user", "content": "\n".join(text)}] if text else []
    return [*before, {"role": "tool", "tool_call_id": b.tool_use_id, "content": ("Error: " + content) if b.is_error else content}]


def chat_request(req: CountTokensRequest, messages: list[dict[str, Any]], n_tools: int | None = None) -> ChatCompletionRequest:
    """The chat pipeline's request for these messages with the request's tools (the first ``n_tools``) and sampling."""
    tools = (req.tools or [])[:n_tools]
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema, "strict": t.strict},
            }
            for t in tools
        ]
        or None,
        "tool_choice": _tool_choice(req) if n_tools is None else ("none" if isinstance(req.tool_choice, ToolChoiceNone) else None),
    }
    if getattr(req.tool_choice, "disable_parallel_tool_use", False):
        body["parallel_tool_calls"] = False  # else the default: several calls allowed (one in the generic format, as llama-server)
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": req.output_config.format.schema_}}
    if isinstance(req, MessagesRequest):
        body.update(temperature=req.temperature, user=req.metadata.user_id if req.metadata else None)
        body.update({k: v for k, v in (("top_p", req.top_p), ("top_k", req.top_k)) if v is not None})
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InvalidRequest(f"{where}: {err['msg']}" if where else err["msg"], param=where or None) from None
    if isinstance(req, MessagesRequest):
        chat.stop = list(req.stop_sequences or [])  # Anthropic allows more stop sequences than OpenAI's four
    return chat


RENAMED = ((".function.parameters", ".input_schema"), ("response_format.json_schema.schema", "output_config.format.schema"))
"""The chat request's field paths as a Messages request names them."""


def in_messages_terms(e: InvalidRequest) -> InvalidRequest:
    """An error about the chat request, naming its fields as the Messages request does (``tools.3.input_schema...``)."""
    message = e.message
    for old, new in RENAMED:
        message = message.replace(old, new)
    param = "output_config" if e.param == "response_format" else e.param
    return InvalidRequest(message, param=param, code=e.code) if message != e.message or param != e.param else e


def _tool_choice(req: CountTokensRequest) -> Any:
    choice = req.tool_choice
    if not req.tools or choice is None:
        return None
    if isinstance(choice, ToolChoiceAny):
        return "required"
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}
    return "none" if isinstance(choice, ToolChoiceNone) else "auto"
