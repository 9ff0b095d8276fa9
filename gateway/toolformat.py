"""Tools for every model: how a request with tools is rendered, constrained and parsed, whatever the chat template.

The format is chosen once per gateway from the chat template and ``KVPOOL_TOOL_FORMAT``
(`ToolFormat.for_template`), as llama-server chooses it (llama.cpp's ``common/chat.cpp``
before its automatic parser: the Hermes format only when the template itself has
``<tool_call>``, else the generic format):

* ``native``: the template renders ``tools`` in the Hermes ``<tool_call>`` format
  (Qwen2.5's, for one): it renders every request.
* ``generic`` (the default for any other template, SmolLM2's ChatML included): the
  model's template renders the messages; the tools are described in the system turn, and
  the answer is one JSON object, ``{"tool_call": {"name": ..., "arguments": {...}}}`` (with
  ``parallel_tool_calls``: ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}``) or
  ``{"response": "..."}``, enforced by a grammar even under ``auto``, so a small model that
  would ramble in text still writes a call it was shown how to write. Calls and results of
  earlier turns are written in the same JSON, results as user turns (many templates know
  no other roles). The JSON is parsed when the answer is complete, so a streamed answer
  comes in one piece at its end; an answer cut short gives what it holds so far
  (`gateway.cutanswer`), never the JSON around it.
* ``hermes`` (``KVPOOL_TOOL_FORMAT=hermes``, ChatML templates only): a request that uses
  tools is rendered with kvpool's own ChatML template in the Hermes format
  (``gateway/templates/chatml-tools.jinja``, shipped in the package); one without keeps
  the model's template, to the token. ``auto`` is free text, parsed for ``<tool_call>``
  blocks, so text streams as it comes and the model may answer without a call; a model
  tuned on Hermes calls does best in it, SmolLM2 rarely calls a tool in it by itself.

In the two Hermes formats a ``required`` or named ``tool_choice`` is a grammar and
``auto`` is parsed from the text (`gateway.tools`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Literal

import jinja2

from gateway.cutanswer import cut_answer
from gateway.errors import InvalidRequest
from gateway.schemas import ChatCompletionRequest, Message
from gateway.settings import ToolFormatChoice
from gateway.structured import Converter, verify_grammar
from gateway.tokenizer import TemplateError, Tokenizer, compile_template
from gateway.tools import (
    ToolStream,
    call_rules,
    new_call_id,
    parse_call,
    supports_tools,
    template_messages,
    template_tools,
    tool_grammar,
    uses_tools,
)

HERMES_TEMPLATE = "chatml-tools.jinja"

GENERIC_INSTRUCTION = "Answer in JSON: with {key} to call tools, or with `response` to reply to the user yourself."
GENERIC_TOOLS = "These are the tools you may call to do what the user asks: {tools}\n\nThis is how a tool call looks:\n\n{example}"
_EXAMPLE_CALL = {"name": "tool_name", "arguments": {"arg1": "some_value"}}

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
        except (json.JSONDecodeError, RecursionError):
            return self._cut(text)
        if not isinstance(doc, dict):
            return self._content(text)
        written = doc.get("tool_calls", [doc["tool_call"]] if "tool_call" in doc else None)
        calls = [parse_call(c, self.names) if isinstance(c, dict) else None for c in written] if isinstance(written, list) else []
        if calls and None not in calls:
            return [d for call in calls if call is not None for d in self._call_deltas(call)]
        if isinstance(doc.get("response"), str):
            return self._content(doc["response"])
        return self._content(text)

    def _cut(self, text: str) -> list[dict[str, Any]]:
        """An answer cut short (max_tokens): its text so far, or its calls so far (the last one's arguments cut), never the JSON around them."""
        content, calls = cut_answer(text)
        out = self._content(content)
        for name, arguments in calls:
            if name in self.names:
                out += self._call_deltas({"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}})
        return out


class ToolFormat:
    def __init__(self, kind: Kind, template: jinja2.Template | None = None) -> None:
        self.kind = kind
        self.template = template
        """The template that renders requests with tools (``hermes``); None: the model's."""

    @classmethod
    def for_template(cls, source: str, choice: ToolFormatChoice = ToolFormatChoice.AUTO) -> ToolFormat:
        """The format for a chat template. Raises `ValueError` for ``hermes`` with a template that is not ChatML."""
        if choice == ToolFormatChoice.GENERIC:
            return cls("generic")
        if supports_tools(source):
            return cls("native")
        if choice == ToolFormatChoice.HERMES:
            if "<|im_start|>" not in source:
                raise ValueError("KVPOOL_TOOL_FORMAT=hermes needs a ChatML chat template (<|im_start|>); this model's is not one")
            return cls("hermes", compile_template(packaged_template()))
        return cls("generic")

    def template_inputs(
        self, req: ChatCompletionRequest
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, jinja2.Template | None]:
        """What the chat template renders: the messages, the tools, and the template (None: the model's)."""
        if not uses_tools(req):
            return template_messages(req.messages), None, None
        if self.kind != "generic":
            return template_messages(req.messages), template_tools(req), self.template
        return generic_messages(req), None, None

    def render(self, tokenizer: Tokenizer, req: ChatCompletionRequest) -> str:
        """The prompt's text. Raises `TemplateError`."""
        messages, tools, template = self.template_inputs(req)
        try:
            return tokenizer.render_chat(messages, tools, template)
        except TemplateError:
            if self.kind != "generic" or not uses_tools(req) or messages[0]["role"] != "system" or len(messages) < 2:
                raise
            return tokenizer.render_chat(_system_into_user(messages))  # a template that knows no system turn

    def written_answer(self, text: str, req: ChatCompletionRequest) -> str:
        """How an earlier answer of plain text is written into the prompt."""
        if self.kind == "generic" and req.tools_offered():
            return json.dumps({"response": text}, ensure_ascii=False)
        return text

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
        conv = Converter()
        call = conv._add_rule("generic-call", " | ".join(call_rules(req, conv)))
        if parallel_calls(req):
            rules = [
                conv._add_rule("calls", f'"{{" space {_key("tool_calls")} "[" space {call} ( "," space {call} )* "]" space "}}" space')
            ]
        else:
            rules = [conv._add_rule("one-call", f'"{{" space {_key("tool_call")} {call} "}}" space')]
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


def parallel_calls(req: ChatCompletionRequest) -> bool:
    """Whether a generic answer may hold several calls: only when the request asks (llama-server's default is one call)."""
    return req.parallel_tool_calls and "parallel_tool_calls" in req.model_fields_set


def _key(name: str) -> str:
    """A JSON object's key and its colon, as the grammar writes them."""
    return f'"\\"{name}\\"" space ":" space'


def generic_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages with calls, results and (when tools are offered) answers written in the generic JSON, the tools in the system turn."""
    out: list[dict[str, Any]] = []
    for m, d in zip(req.messages, template_messages(req.messages)):
        role, content = d["role"], _generic_content(m, d, req)
        if role == "tool":
            role = "user"
        if out and out[-1]["role"] == role == "user":
            out[-1]["content"] += "\n" + content
        else:
            out.append({"role": role, "content": content})
    if req.tools_offered():
        prompt = generic_prompt(template_tools(req) or [], parallel_calls(req))
        if out and out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def generic_prompt(tools: list[dict[str, Any]], parallel: bool) -> str:
    """What the system turn says about the tools: the JSON to answer with, the tools, an example call."""
    example = {"tool_calls": [_EXAMPLE_CALL]} if parallel else {"tool_call": _EXAMPLE_CALL}
    return (
        GENERIC_INSTRUCTION.format(key="`tool_calls`" if parallel else "`tool_call`")
        + "\n\n"
        + GENERIC_TOOLS.format(tools=json.dumps(tools, ensure_ascii=False, indent=2), example=json.dumps(example, indent=2))
    )


def _generic_content(m: Message, d: dict[str, Any], req: ChatCompletionRequest) -> str:
    if m.role == "tool":
        return json.dumps({"tool_response": {"id": m.tool_call_id, "content": m.text()}}, ensure_ascii=False)
    if m.role != "assistant":
        return str(d["content"])
    calls = [c["function"] for c in d["tool_calls"] or []]
    if not calls:
        return json.dumps({"response": m.text()}, ensure_ascii=False) if req.tools_offered() else m.text()
    written = {"tool_calls": calls} if parallel_calls(req) or len(calls) > 1 else {"tool_call": calls[0]}
    text = [json.dumps({"response": m.text()}, ensure_ascii=False)] if m.text() else []
    return "\n".join([*text, json.dumps(written, ensure_ascii=False)])


def _system_into_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system, first, *rest = messages
    return [{**first, "content": system["content"] + "\n\n" + first["content"]}, *rest]
