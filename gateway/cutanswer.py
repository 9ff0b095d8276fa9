"""A generic-format answer cut short (``max_tokens``, or the end of the context): what it holds, in the protocol's terms.

The generic tool format (`gateway.toolformat`) has the model answer in one JSON object,
``{"response": "..."}`` or ``{"tool_call": {"name": ..., "arguments": {...}}}`` (or
``{"tool_calls": [...]}``). Cut, it does not parse; the client must still never see the
wrapper. What it gets is what the protocols give for a cut answer: the reply's text so
far, or the calls so far, the last one with its arguments as far as they were written
(OpenAI's ``finish_reason: length`` with a partial ``arguments`` string, Anthropic's
``stop_reason: max_tokens``). A call whose name was not finished is dropped.
"""

from __future__ import annotations

import json
import re

RESPONSE = re.compile(r'\s*\{\s*"response"\s*:\s*"')
ONE_CALL = re.compile(r'\s*\{\s*"tool_call"\s*:\s*')
MANY_CALLS = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[\s*')
CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_ESCAPE_TAIL = 12
"""Characters an unfinished escape at the cut can hold (``\\ud83d\\ude0`` and such)."""

Call = tuple[str, str]
"""A function's name and its arguments as written (JSON, perhaps cut)."""


def cut_answer(text: str) -> tuple[str, list[Call]]:
    """The reply's text and the calls a cut generic answer holds (both empty when it holds neither yet)."""
    if m := RESPONSE.match(text):
        return partial_string(text[m.end() :]), []
    if m := ONE_CALL.match(text):
        call = _cut_call(text[m.end() :])
        return "", [call] if call else []
    if m := MANY_CALLS.match(text):
        return "", _calls(text[m.end() :])
    return "", []


def partial_string(body: str) -> str:
    """The text of a JSON string's body up to its closing quote or the cut (an escape the cut split is dropped)."""
    end, escaped = len(body), False
    for i, c in enumerate(body):
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            end = i
            break
    head = body[:end]
    for k in range(min(_ESCAPE_TAIL, len(head)) + 1):
        try:
            text = json.loads('"' + head[: len(head) - k] + '"', strict=False)
            text.encode("utf-8")  # no lone surrogate (half of a pair the cut split)
            return str(text)
        except (json.JSONDecodeError, UnicodeEncodeError):
            continue
    return ""


def _cut_call(rest: str) -> Call | None:
    m = CALL_HEAD.match(rest)
    if m is None:
        return None
    return json.loads('"' + m.group(1) + '"', strict=False), rest[m.end() :]


def _calls(rest: str) -> list[Call]:
    """The calls of a cut ``tool_calls`` list: the whole ones, then the one the cut fell in."""
    calls: list[Call] = []
    decoder = json.JSONDecoder(strict=False)
    while rest.startswith("{"):
        try:
            doc, end = decoder.raw_decode(rest)
        except (json.JSONDecodeError, RecursionError):
            call = _cut_call(rest)
            return calls + ([call] if call else [])
        if isinstance(doc, dict) and isinstance(doc.get("name"), str):
            calls.append((doc["name"], json.dumps(doc.get("arguments", {}), ensure_ascii=False)))
        rest = rest[end:].lstrip().removeprefix(",").lstrip()
    return calls
