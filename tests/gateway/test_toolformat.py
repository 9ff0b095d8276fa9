"""Which tool format a chat template gets, and how the generic format writes a conversation: no model needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.schemas import ChatCompletionRequest
from gateway.settings import ToolFormatChoice
from gateway.toolformat import JsonToolStream, ToolFormat, generic_messages, packaged_template
from tests.gateway.test_tools import ZEPHYR

REPO = Path(__file__).resolve().parents[2]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


def test_each_template_gets_its_format() -> None:
    hermes = packaged_template()
    assert ToolFormat.for_template(hermes).kind == "native"  # it renders tools in the <tool_call> format itself
    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    assert ToolFormat.for_template(chatml).kind == "generic"  # as llama-server: no <tool_call> in the template, the generic format
    assert ToolFormat.for_template(ZEPHYR).kind == "generic"
    assert ToolFormat.for_template(chatml, ToolFormatChoice.HERMES).kind == "hermes"  # KVPOOL_TOOL_FORMAT=hermes
    assert ToolFormat.for_template(hermes, ToolFormatChoice.HERMES).kind == "native"
    assert ToolFormat.for_template(hermes, ToolFormatChoice.GENERIC).kind == "generic"
    with pytest.raises(ValueError, match="ChatML"):
        ToolFormat.for_template(ZEPHYR, ToolFormatChoice.HERMES)


def test_the_hermes_template_ships_inside_the_package() -> None:
    assert "<tool_call>" in packaged_template()
    assert (REPO / "gateway" / "templates" / "chatml-tools.jinja").read_text() == packaged_template()
    assert 'gateway = ["templates/*.jinja"]' in (REPO / "pyproject.toml").read_text()  # package data: installed with the gateway


def test_the_generic_format_writes_calls_results_and_answers_as_json() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "tools": [TOOL],
            "messages": [
                {"role": "user", "content": "What is 2+3?"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "5"},
                {"role": "user", "content": "Thanks."},
                {"role": "assistant", "content": "You are welcome."},
                {"role": "user", "content": "Bye."},
            ],
        }
    )
    out = generic_messages(req)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert '"name": "add"' in out[0]["content"] and "tool_call" in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_call": {"name": "add", "arguments": {"a": 2}}}
    assert out[3]["content"].splitlines() == [json.dumps({"tool_response": {"id": "c1", "content": "5"}}), "Thanks."]
    assert json.loads(out[4]["content"]) == {"response": "You are welcome."}


def test_a_generic_answer_is_parsed_once_complete() -> None:
    stream = JsonToolStream(("add",))
    assert stream.push('{"tool_call": {"name": "add", ') == [] and stream.push('"arguments": {"a": 1}}}') == []
    deltas = stream.flush()
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "add" and json.loads(stream.calls[0]["function"]["arguments"]) == {"a": 1}
    answer = JsonToolStream(("add",))
    answer.push('{"response": "Five."}')
    assert answer.flush() == [{"content": "Five."}] and answer.calls == []


CUT = [
    ('{"response": "Five and', "Five and", []),
    ('{"response": "one\\ntwo \\u00e', "one\ntwo", []),  # an escape the cut split is dropped (and the space before it held back)
    ('{"tool_call": {"name": "add", "arguments": {"a": 1, "b"', "", [("add", '{"a": 1, "b"')]),
    (
        '{"tool_calls": [{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a"',
        "",
        [("add", '{"a": 1}'), ("add", '{"a"')],
    ),
    ('{"tool_call": {"name": "ad', "", []),  # no name yet: no call
    ('{"tool_call": {"name": "rm", "arguments": {', "", []),  # a function that was not offered
    ('{"', "", []),
]


@pytest.mark.parametrize("text,content,calls", CUT, ids=[c[0] for c in CUT])
def test_a_generic_answer_cut_short_gives_its_text_or_its_calls_never_the_json_around_them(text: str, content: str, calls: list) -> None:
    stream = JsonToolStream(("add",))
    stream.push(text)
    deltas = stream.flush()
    assert "".join(d.get("content", "") for d in deltas) == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in stream.calls] == calls
