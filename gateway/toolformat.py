"""Tools for every model: how a request with tools is rendered, constrained and parsed, whatever the chat template.

The format is chosen once per gateway from the chat template (`ToolFormat.for_template`):

* ``native``: the template renders ``tools`` in the Hermes ``<tool_call>`` format
  (Qwen2.5's, for one): it renders every request.
* ``hermes``: a ChatML template that renders no tools (SmolLM2's, for one): a request
  that uses tools is rendered with kvpool's own ChatML template in the Hermes format
  (``gateway/templates/chatml-tools.jinja``, shipped in the package); one without keeps
  the model's template, to the token.
* ``generic``: any other template (as llama.cpp's generic format): the model's template
  renders the messages; the tools are described in the system turn, and the answer is
  one JSON object, ``{"tool_call": {"name": ..., "arguments": {...}}}`` or
  ``{"response": "..."}``, enforced by a grammar. Calls and results of earlier turns
  are written in the same JSON, results as user turns (many templates know no other
  roles). The JSON is parsed when the answer is complete, so a streamed answer comes in
  one piece at its end.

In the two Hermes formats a ``required`` or named ``tool_choice`` is a grammar and
``auto`` is parsed from the text (`gateway.tools`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Literal

import jinja2
from llama_cpp.llama_grammar import SchemaConverter

from gateway.errors import InvalidRequest
from gateway.schemas import ChatCompletionRequest, Message
from gateway.structured import verify_grammar
from gateway.tokenizer import TemplateError, Tokenizer, compile_template
from gateway.tools import ToolStream, call_rules, parse_call, supports_tools, template_messages, template_tools, tool_grammar, uses_tools

HERMES_TEMPLATE = "chatml-tools.jinja"

GENERIC_PROMPT = (
    "You can call these tools:\n{tools}\n\n"
    'Answer with one JSON object: {{"tool_call": {{"name": <the tool\'s name>, "arguments": <its arguments>}}}} to call a tool, '
    'or {{"response": <your answer>}} to answer directly.'
)

Kind = Literal["native", "hermes", "generic"]


def packaged_template(name: str = HERMES_TEMPLATE) -> str:
    """A chat template shipped inside the package (found wherever the gateway is installed)."""
    return files("gateway").joinpath("templates", name).read_text(encoding="utf-8")


@dataclass(frozen=True)
class Offered:
    """The functions an answer may call, and whether it writes them as generic JSON: what parses its text."""

    names: tuple[str, ...]
    generic: bool = False

    def stream(self) -> ToolStream:
        return JsonToolStream(self.names) if self.generic else ToolStream(self.names)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The message's content (None when empty) and its tool calls."""
        stream = self.stream()
        deltas = stream.push(text) + stream.flush()
        content = "".join(d["content"] for d in deltas if "content" in d)
        return content or None, stream.calls


class JsonToolStream(ToolStream):
    """A generic-format answer: held until it is complete, then one content delta or one call's deltas."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__(names)
        self._json = ""

    def push(self, text: str) -> list[dict[str, Any]]:
        self._json += text
        return []

    def flush(self) -> list[dict[str, Any]]:
        text, self._json = self._json, ""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            return self._content(text)  # cut short (max_tokens): what there is, as text
        if isinstance(doc, dict) and isinstance(doc.get("tool_call"), dict):
            call = parse_call(doc["tool_call"], self.names)
            if call is not None:
                return self._call_deltas(call)
        if isinstance(doc, dict) and isinstance(doc.get("response"), str):
            return self._content(doc["response"])
        return self._content(text)


class ToolFormat:
    def __init__(self, kind: Kind, template: jinja2.Template | None = None) -> None:
        self.kind = kind
        self.template = template
        """The template that renders requests with tools (``hermes``); None: the model's."""

    @classmethod
    def for_template(cls, source: str) -> ToolFormat:
        if supports_tools(source):
            return cls("native")
        if "<|im_start|>" in source:
            return cls("hermes", compile_template(packaged_template()))
        return cls("generic")

    def render(self, tokenizer: Tokenizer, req: ChatCompletionRequest) -> str:
        """The prompt's text. Raises `TemplateError`."""
        if not uses_tools(req):
            return tokenizer.render_chat(template_messages(req.messages))
        if self.kind != "generic":
            return tokenizer.render_chat(template_messages(req.messages), template_tools(req), self.template)
        messages = generic_messages(req)
        try:
            return tokenizer.render_chat(messages)
        except TemplateError:
            if messages[0]["role"] != "system" or len(messages) < 2:
                raise
            return tokenizer.render_chat(_system_into_user(messages))  # a template that knows no system turn

    def grammar(self, req: ChatCompletionRequest, vocab: Any) -> str | None:
        """The grammar the tools ask for (None: none; the response format's applies)."""
        if self.kind != "generic":
            return tool_grammar(req, vocab)
        if not req.tools_offered():
            return None
        if req.response_format is not None and req.response_format.type != "text":
            raise InvalidRequest(
                "the model's chat template has no tool format, so its tools are answered as JSON by a grammar; "
                "a JSON response_format cannot be added to it (one grammar per answer)",
                param="response_format",
            )
        conv = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        rules = call_rules(req, conv, lambda call: {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"]})
        if not req.forced_tools():
            rules.append(conv.visit({"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}, "answer"))
        conv._add_rule("root", " | ".join(rules))
        grammar: str = conv.format_grammar()
        verify_grammar(vocab, grammar, "tools")
        return grammar

    def offered(self, req: ChatCompletionRequest) -> Offered | None:
        if not req.tools_offered():
            return None
        return Offered(tuple(t.function.name for t in req.tools or []), generic=self.kind == "generic")


def generic_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages with calls, results and (when tools are offered) answers written in the generic JSON, the tools in the system turn."""
    out: list[dict[str, Any]] = []
    for m, d in zip(req.messages, template_messages(req.messages)):
        role, content = d["role"], _generic_content(m, d, req.tools_offered())
        if role == "tool":
            role = "user"
        if out and out[-1]["role"] == role == "user":
            out[-1]["content"] += "\n" + content
        else:
            out.append({"role": role, "content": content})
    if req.tools_offered():
        prompt = GENERIC_PROMPT.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in template_tools(req) or []))
        if out and out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _generic_content(m: Message, d: dict[str, Any], offered: bool) -> str:
    if m.role == "tool":
        return json.dumps({"tool_response": {"id": m.tool_call_id, "content": m.text()}}, ensure_ascii=False)
    if m.role != "assistant":
        return str(d["content"])
    calls = [json.dumps({"tool_call": c["function"]}, ensure_ascii=False) for c in d["tool_calls"] or []]
    if calls:
        return "\n".join(([json.dumps({"response": m.text()}, ensure_ascii=False)] if m.text() else []) + calls)
    return json.dumps({"response": m.text()}, ensure_ascii=False) if offered else m.text()


def _system_into_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system, first, *rest = messages
    return [{**first, "content": system["content"] + "\n\n" + first["content"]}, *rest]
