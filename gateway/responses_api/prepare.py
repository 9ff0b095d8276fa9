"""From a Responses API request to a job: the conversation's items, the prompt's token ids, the grammar.

The request is mapped onto a chat request (`gateway.schemas.ChatCompletionRequest`), so
that tools, ``tool_choice``, JSON schemas and sampling go through the same checks, chat
template and grammars as ``/v1/chat/completions``.

A follow-up (``previous_response_id``) does not re-render the conversation. Its prompt is
the previous response's prompt tokens, then the tokens the model generated, then the new
turn rendered *as a continuation*: the template renders a stand-in conversation whose
last assistant message is a sentinel, and everything after the sentinel is the new turn
(for ChatML: ``<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``).
So the prefix is the very tokens the pool evaluated and published (the worker publishes the
answer's cells with them once the answer is out, `worker.answering.Engine.after_answer`), never a re-tokenization of the
answer's text that could differ from them. This holds while the previous response was
made under the same *render key* (model, template, instructions, tools); when a follow-up
changes its instructions or tools (instructions are not carried over, as in OpenAI's API),
the whole conversation is rendered again from its items.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from gateway.errors import InvalidRequest
from gateway.prepare import Prepared, Preparer
from gateway.responses_api.items import chat_messages, public_item, resolve_outputs
from gateway.responses_api.schemas import ResponseCreate, TextFormat, Tools, chat_tool_choice, parse_items, parse_tools
from gateway.responses_api.state import Stored
from gateway.schemas import ChatCompletionRequest, Message
from gateway.structured import response_grammar
from gateway.tenants import Tenant
from gateway.tokenizer import TemplateError
from gateway.toolformat import Offered
from gateway.tools import template_tools

SENTINEL = "KVPOOL-CONTINUE-5c1e7a"
"""Stands in for the previous answer when the new turn is rendered as its continuation."""

_RENAMED = (
    ("messages", "input"),
    ("response_format.json_schema.", "text.format."),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    (".function.parameters", ".parameters"),
)
_PARAMS = {"messages": "input", "response_format": "text", "max_completion_tokens": "max_output_tokens"}


@dataclass(frozen=True)
class Turn:
    prepared: Prepared
    items: list[dict[str, Any]]
    """The conversation's input items: the previous response's history, then this request's input."""
    render_key: str
    tools: Offered | None
    """The functions the answer may call, and how their calls are written."""
    continued: int
    """Leading prompt tokens taken as they were from the previous response (0: the prompt was rendered)."""
    namespaces: dict[str, str] = field(default_factory=dict)
    """The namespace tool of each function that came in one (its calls name it)."""
    left_out: list[str] = field(default_factory=list)
    """The built-in tools left out of the prompt (kvpool cannot run them), by type."""


def prepare_turn(preparer: Preparer, req: ResponseCreate, tenant: Tenant, prev: Stored | None) -> Turn:
    preparer.check_model(req.model)
    req.refused()
    new = [public_item(i) for i in parse_items(req.input)]
    history = prev.history if prev is not None else []
    resolve_outputs(history, new)
    _check_calls(history, new)
    tools = parse_tools(req.tools)
    chat = _chat_request(req, chat_messages(history + new), tools)
    tok = preparer.tokenizer
    key = render_key(preparer, req.instructions, template_tools(chat))
    tokens, continued = _tokens(preparer, chat, new, prev if prev is not None and prev.render_key == key else None)
    n_ctx = preparer.settings.n_ctx
    if len(tokens) >= n_ctx:
        raise InvalidRequest(
            f"the input is {len(tokens)} tokens (the conversation so far included), which fills the model's context of {n_ctx} "
            "tokens; start a shorter conversation",
            param="input",
            code="context_length_exceeded",
        )
    budget = min(chat.token_budget(n_ctx), n_ctx - len(tokens))  # up to the end of the context at most, as llama-server
    prepared = preparer._job(chat, tokens, budget, tok.chat_stops, None, tenant, chat=True, grammar=_grammar(preparer, chat, tools.paths))
    offered = preparer.tool_format.offered(chat)
    return Turn(Prepared(prepared.spec, chat=True, tools=offered), history + new, key, offered, continued, tools.namespaces, tools.left_out)


def render_key(preparer: Preparer, instructions: str | None, tools: list[dict[str, Any]] | None) -> str:
    """What a prompt's tokens depend on besides the conversation: equal keys let a follow-up continue the stored tokens."""
    doc = json.dumps(
        [preparer.fingerprint, preparer.tokenizer.template_source, preparer.tool_format.kind, instructions, tools], sort_keys=True
    )
    return hashlib.sha256(doc.encode()).hexdigest()[:32]


def _check_calls(history: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
    """Every function call's arguments are JSON, and every output answers a call made before it."""
    calls = {i["call_id"] for i in history if i["type"] == "function_call"}
    for n, item in enumerate(new):
        if item["type"] == "function_call":
            calls.add(item["call_id"])
            try:
                json.loads(item["arguments"] or "{}")
            except (json.JSONDecodeError, RecursionError):
                raise InvalidRequest(f"input.{n}.arguments: must be JSON (an object in a string)", param="input") from None
        elif item["type"] == "function_call_output" and item["call_id"] not in calls:
            raise InvalidRequest(
                f"input.{n}.call_id: no function_call with call_id {item['call_id']!r} comes before this output "
                "(in this input or the conversation of previous_response_id)",
                param="input",
            )


def _renamed(message: str) -> str:
    for old, new in _RENAMED:
        message = message.replace(old, new)
    return message


def _response_format(fmt: TextFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def _chat_request(req: ResponseCreate, messages: list[dict[str, Any]], offered: Tools) -> ChatCompletionRequest:
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in offered.functions]
    body = {
        "model": req.model,
        "messages": system + messages,
        "tools": tools or None,
        "tool_choice": chat_tool_choice(req.tool_choice),
        **({"parallel_tool_calls": req.parallel_tool_calls} if "parallel_tool_calls" in req.model_fields_set else {}),
        "response_format": _response_format(req.text.format if req.text else None),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "user": req.user,
        "prompt_cache_key": req.prompt_cache_key,
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        message = _renamed(f"{'.'.join(loc)}: {err['msg']}" if loc else err["msg"].removeprefix("Value error, "))
        param = _PARAMS.get(loc[0], loc[0]) if loc else next((p for p in ("tool_choice", "tools", "text") if p in message), None)
        raise InvalidRequest(message, param=param) from None


def continuation(preparer: Preparer, chat: ChatCompletionRequest, new: list[Message]) -> str | None:
    """The text that follows a finished answer: its end of turn, ``new``, the generation prompt (None if the template hides it).

    ``chat`` gives the tools and how they are written (`gateway.toolformat.ToolFormat`).
    """
    fmt = preparer.tool_format
    lead = [Message(role="user", content="?"), Message(role="assistant", content=SENTINEL)]
    stand_in = chat.model_copy(update={"messages": lead + new})
    try:
        text = fmt.render(preparer.tokenizer, stand_in)
    except TemplateError as e:
        raise InvalidRequest(str(e), param="input") from None
    marker = fmt.written_answer(SENTINEL, stand_in)
    if text.count(marker) != 1:
        return None
    return text[text.index(marker) + len(marker) :]


def _tokens(preparer: Preparer, chat: ChatCompletionRequest, new: list[dict[str, Any]], prev: Stored | None) -> tuple[list[int], int]:
    """The prompt: the previous response's tokens and the new turn's (when it can continue them), else the whole conversation rendered."""
    tok = preparer.tokenizer
    try:
        if prev is not None:
            text = continuation(preparer, chat, [Message.model_validate(m) for m in chat_messages(new)])
            if text is not None:
                return prev.tokens + tok.llm.tokenize(text.encode(), add_bos=False, special=True), len(prev.tokens)
        try:
            text = preparer.tool_format.render(tok, chat)
        except TemplateError as e:
            raise InvalidRequest(str(e), param="input") from None
        return tok.tokenize(text, special=True), 0
    except InvalidRequest as e:
        raise InvalidRequest(_renamed(e.message), param="input") from None


def _grammar(preparer: Preparer, chat: ChatCompletionRequest, paths: list[str]) -> str | None:
    """The answer's grammar; an error names the field as the request does (a namespace's function: ``tools.4.tools.0...``)."""
    vocab = preparer.tokenizer.llm._model.vocab
    try:
        return preparer.tool_format.grammar(chat, vocab) or response_grammar(chat.response_format, vocab)
    except InvalidRequest as e:
        message = re.sub(r"\btools\.(\d+)\.function\.", lambda m: f"{paths[int(m[1])]}." if int(m[1]) < len(paths) else m[0], e.message)
        raise InvalidRequest(_renamed(message), param=_PARAMS.get(e.param or "", e.param)) from None
