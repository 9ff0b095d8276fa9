"""Tool calling: rendering tools with the model's chat template, forcing a call with a grammar, parsing calls out of the text.

kvpool speaks the Hermes format that Qwen2.5's template (and kvpool's own
``gateway/templates/chatml-tools.jinja``) uses: tools listed in the system turn, each call
a ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block, each result a
``tool`` message. A template that renders no ``tools`` in this format gets them another
way (`gateway.toolformat`).

``tool_choice`` ``required`` or a named function is enforced by a grammar: one call (or,
with ``parallel_tool_calls``, one or more) whose arguments match the function's
``parameters`` schema. ``auto`` lets the model choose; its text is parsed afterwards.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import jinja2
from jinja2 import meta
from llama_cpp.llama_grammar import SchemaConverter

from gateway.errors import InvalidRequest
from gateway.schemas import ChatCompletionRequest, Message, NamedToolChoice
from gateway.structured import Converter, SchemaError, check_schema, verify_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def supports_tools(template_source: str) -> bool:
    """Whether the chat template renders ``tools`` in the format kvpool parses."""
    try:
        names = meta.find_undeclared_variables(jinja2.Environment().parse(template_source))
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in names and OPEN in template_source


def uses_tools(req: ChatCompletionRequest) -> bool:
    return req.tools_offered() or any(m.role == "tool" or m.tool_calls for m in req.messages)


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them; a tool call's arguments as an object (Hugging Face's convention)."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text(), "tool_calls": None}
        if m.tool_calls:
            d["tool_calls"] = [
                {"type": "function", "id": c.id, "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments, i)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _arguments(raw: str, i: int) -> Any:
    try:
        return json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        raise InvalidRequest(
            f"messages.{i}.tool_calls: arguments must be a JSON object in a string, got {raw[:40]!r}", param="messages"
        ) from None


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not req.tools_offered():
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in req.tools or []]


def call_rules(req: ChatCompletionRequest, conv: SchemaConverter, wrap: Any = None) -> list[str]:
    """One grammar rule per function the request allows to be called: ``{"name": ..., "arguments": {...}}``.

    ``wrap`` puts that object inside another (a format's envelope); every ``parameters``
    schema is checked first: a hint loosened to what the grammar can enforce, or, for a
    function with ``strict: true``, refused with a 400 naming the path of what it cannot.
    """
    named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
    calls = []
    for i, tool in enumerate(req.tools or []):
        f = tool.function
        if named is not None and f.name != named:
            continue
        params = f.parameters or {"type": "object", "properties": {}}
        try:
            params = check_schema(params, f"tools.{i}.function.parameters", strict=f.strict is True)
            resolved = conv.resolve_refs(params, f"tool-{i}")
            call = {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": resolved},
                "required": ["name", "arguments"],
            }
            calls.append(conv.visit(wrap(call) if wrap else call, f"call-{i}"))
        except (AssertionError, ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
            raise SchemaError(f"tools.{i}.function.parameters", f"cannot be turned into a grammar: {e}") from None
    return calls


def tool_grammar(req: ChatCompletionRequest, vocab: Any) -> str | None:
    """For a required or named ``tool_choice``: the grammar of one call (or several) to the allowed functions."""
    if not req.forced_tools():
        return None
    conv = Converter()
    calls = call_rules(req, conv)
    block = conv._add_rule("tool-call-block", f'"{OPEN}\\n" ( {" | ".join(calls)} ) "\\n{CLOSE}"')
    conv._add_rule("root", f'{block} ( "\\n" {block} )*' if req.parallel_tool_calls else block)
    grammar: str = conv.format_grammar()
    verify_grammar(vocab, grammar, "tools")
    return grammar


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_call(block: str | dict[str, Any], names: tuple[str, ...]) -> dict[str, Any] | None:
    """One ``<tool_call>`` block's call (its text, or its JSON already parsed), or None when it is not a call to one of the tools."""
    try:
        doc = json.loads(block) if isinstance(block, str) else block
    except json.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or doc.get("name") not in names:
        return None
    args = doc.get("arguments", doc.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"id": new_call_id(), "type": "function", "function": {"name": doc["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_calls(text: str, names: tuple[str, ...]) -> tuple[str | None, list[dict[str, Any]]]:
    """The message's content (the text outside its calls, None when empty) and its tool calls."""
    stream = ToolStream(names)
    deltas = stream.push(text) + stream.flush()
    content = "".join(d["content"] for d in deltas if "content" in d)
    return content or None, stream.calls


class ToolStream:
    """Splits streamed text into content deltas and OpenAI-style ``tool_calls`` deltas.

    Text that could be the start of ``<tool_call>`` is held back until it is clearly not;
    a call is sent once its block is closed, as two deltas (id and name, then the
    arguments), the way OpenAI streams them. Whitespace around calls is dropped.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.calls: list[dict[str, Any]] = []
        self._buf = ""
        self._ws = ""
        self._started = False

    def push(self, text: str) -> list[dict[str, Any]]:
        self._buf += text
        out: list[dict[str, Any]] = []
        while True:
            if self._buf.startswith(OPEN):
                end = self._buf.find(CLOSE)
                if end < 0:
                    return out
                block, self._buf = self._buf[len(OPEN) : end], self._buf[end + len(CLOSE) :]
                out += self._block(block)
                continue
            at = self._buf.find(OPEN)
            if at < 0:
                hold = max((k for k in range(1, len(OPEN)) if self._buf.endswith(OPEN[:k])), default=0)
                at = len(self._buf) - hold
                out += self._content(self._buf[:at])
                self._buf = self._buf[at:]
                return out
            out += self._content(self._buf[:at])
            self._buf = self._buf[at:]

    def flush(self) -> list[dict[str, Any]]:
        """The end of the choice: whatever is held back is content (an unclosed block included)."""
        rest, self._buf = self._buf, ""
        return self._content(rest)

    def _block(self, block: str) -> list[dict[str, Any]]:
        call = parse_call(block, self.names)
        if call is None:
            return self._content(OPEN + block + CLOSE)
        return self._call_deltas(call)

    def _call_deltas(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        k = len(self.calls)
        self.calls.append(call)
        fn = call["function"]
        return [
            {"tool_calls": [{"index": k, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}]},
            {"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]},
        ]

    def _content(self, text: str) -> list[dict[str, Any]]:
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        if not self._started:
            body = body.lstrip()
        if not body:
            return []
        self._started = True
        return [{"content": body}]
