"""Tools on the default model as it ships: SmolLM2's ChatML template renders no tools, so it gets llama.cpp's generic format.

The answer is forced by a grammar into one JSON object, a call or a reply, even under
``tool_choice="auto"``, as llama-server does for such a template; so a client that only
binds a tool gets a tool call, through chat completions and the Responses API alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.schemas import ChatCompletionRequest
from gateway.toolformat import JsonToolStream, ToolFormat, generic_messages
from tests.helpers import SMOL, Pool, running_pool

anthropic = pytest.importorskip("anthropic")
langchain_openai = pytest.importorskip("langchain_openai")
openai = pytest.importorskip("openai")

ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
}
CHAT_ADD = {"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def default_pool(redis_server, s3_server, smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """One worker and a gateway serving SmolLM2 as `kvpool up` does: no template file, no tool setting."""
    with running_pool(redis_server, s3_server, smollm2, tmp_path_factory.mktemp("default-tools"), ["smol-1"]) as pool:
        yield pool


def client(pool: Pool) -> openai.OpenAI:
    return openai.OpenAI(base_url=pool.gateway.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_bind_tools_with_the_default_tool_choice_gives_a_tool_call(default_pool: Pool) -> None:
    chat = langchain_openai.ChatOpenAI(
        model=SMOL, base_url=default_pool.gateway.url + "/v1", api_key="unused", temperature=0, max_retries=0, timeout=300
    )
    message = chat.bind_tools([add]).invoke("What is 2+3?")
    [call] = message.tool_calls  # one call: the generic format writes several only when parallel_tool_calls is asked for
    assert call["name"] == "add" and call["id"].startswith("call_")
    assert call["args"] == {"a": 2, "b": 3} and all(type(v) is int for v in call["args"].values())
    assert message.response_metadata["finish_reason"] == "tool_calls" and not message.content


def test_a_reply_and_a_streamed_call_in_the_generic_format(default_pool: Pool) -> None:
    c = client(default_pool)
    ask = [{"role": "user", "content": "What is 2+3?"}]
    forced = c.chat.completions.create(model=SMOL, messages=ask, tools=[CHAT_ADD], tool_choice="required", temperature=0, max_tokens=60)
    [call] = forced.choices[0].message.tool_calls
    history = [*ask, forced.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    after = c.chat.completions.create(model=SMOL, messages=history, tools=[CHAT_ADD], tool_choice="none", temperature=0, max_tokens=30)
    assert after.choices[0].message.content and not after.choices[0].message.tool_calls
    chunks = list(c.chat.completions.create(model=SMOL, messages=ask, tools=[CHAT_ADD], temperature=0, max_tokens=60, stream=True))
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    assert deltas and deltas[0].function.name == "add"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)).keys() == {"a", "b"}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]


def test_an_answer_cut_by_max_tokens_is_its_text_or_an_unfinished_call_never_the_json_around_it(default_pool: Pool) -> None:
    c = client(default_pool)
    ask = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    told = c.chat.completions.create(model=SMOL, messages=ask, tools=[CHAT_ADD], tool_choice="auto", temperature=0, max_tokens=8)
    choice = told.choices[0]
    assert choice.finish_reason == "length"
    assert not (choice.message.content or "").lstrip().startswith("{"), choice.message.content

    sum_it = [{"role": "user", "content": "What is 123456789+987654321?"}]  # 20 tokens cut the call in its arguments
    cut = c.chat.completions.create(model=SMOL, messages=sum_it, tools=[CHAT_ADD], tool_choice="required", temperature=0, max_tokens=20)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "add" and call.function.arguments.startswith("{")
    chunks = list(
        c.chat.completions.create(
            model=SMOL, messages=sum_it, tools=[CHAT_ADD], tool_choice="required", temperature=0, max_tokens=20, stream=True
        )
    )
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert "".join(d.function.arguments or "" for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []) == (
        call.function.arguments
    )

    messages = anthropic.Anthropic(base_url=default_pool.gateway.url, api_key="unused", max_retries=0, timeout=300).messages
    tool = {"name": "add", "description": ADD["description"], "input_schema": ADD["parameters"]}
    m = messages.create(
        model=SMOL, max_tokens=20, messages=sum_it, tools=[tool], tool_choice={"type": "any"}, extra_body={"temperature": 0}
    )  # type: ignore[arg-type]
    assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["tool_use"]
    told_m = messages.create(model=SMOL, max_tokens=8, messages=ask, tools=[tool], extra_body={"temperature": 0})  # type: ignore[arg-type]
    assert told_m.stop_reason == "max_tokens"
    assert not [b for b in told_m.content if b.type == "text" and b.text.lstrip().startswith("{")], told_m.content


def test_a_responses_call_cut_by_max_output_tokens_is_an_incomplete_item_of_an_incomplete_response(default_pool: Pool) -> None:
    c = client(default_pool)
    ask = dict(model=SMOL, input="What is 123456789+987654321?", tools=[ADD], tool_choice="required", temperature=0, max_output_tokens=20)
    cut = c.responses.create(**ask)  # type: ignore[call-overload]
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    [call] = cut.output
    assert call.type == "function_call" and call.name == "add" and call.arguments.startswith("{")
    assert call.status == "incomplete"  # the item the cut fell in, as OpenAI marks it
    assert [i.status for i in c.responses.retrieve(cut.id).output] == ["incomplete"]

    events = list(c.responses.create(**ask, stream=True))  # type: ignore[call-overload]
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status) for i in done] == [(i.type, i.status) for i in last.response.output] == [("function_call", "incomplete")]
    assert done[0].arguments == call.arguments


def test_parallel_tool_calls_asked_for_gives_a_tool_calls_array(default_pool: Pool) -> None:
    r = client(default_pool).chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": "What is 2+3? And what is 17+25?"}],
        tools=[CHAT_ADD],
        tool_choice="required",
        parallel_tool_calls=True,
        temperature=0,
        max_tokens=120,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    assert len({c.id for c in calls}) == len(calls)
    assert all(c.function.name == "add" and json.loads(c.function.arguments).keys() == {"a", "b"} for c in calls)


def test_responses_function_tool_and_its_output_on_the_default_model(default_pool: Pool) -> None:
    c = client(default_pool)
    first = c.responses.create(model=SMOL, input="What is 2+3?", tools=[ADD], temperature=0, max_output_tokens=60)
    [call] = [i for i in first.output if i.type == "function_call"]
    args = json.loads(call.arguments)
    assert call.name == "add" and call.call_id.startswith("call_") and all(type(v) is int for v in args.values())
    result = {"type": "function_call_output", "call_id": call.call_id, "output": str(add(**args))}
    follow = c.responses.create(model=SMOL, previous_response_id=first.id, input=[result], tools=[ADD], temperature=0, max_output_tokens=80)
    assert follow.status == "completed" and follow.output  # a reply, or another call: the model's choice under auto
    # the follow-up continues the first response's very tokens (its call as the model wrote it), so its prompt is cached
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # the same conversation sent in full, with no stored state: its call and output are written in the same JSON
    items = [{"role": "user", "content": "What is 2+3?"}, call.model_dump(exclude_none=True), result]
    whole = c.responses.create(model=SMOL, input=items, tools=[ADD], tool_choice="none", temperature=0, max_output_tokens=40, store=False)
    assert whole.output_text and not [i for i in whole.output if i.type == "function_call"]


def test_the_generic_format_writes_several_calls_as_one_array() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "tools": [CHAT_ADD],
            "parallel_tool_calls": True,
            "messages": [
                {"role": "user", "content": "Add twice."},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": f"c{i}", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}} for i in (1, 2)
                    ],
                },
            ],
        }
    )
    out = generic_messages(req)
    assert "`tool_calls`" in out[0]["content"] and '"tool_calls": [' in out[0]["content"]  # the instruction and its example
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}] * 2}
    stream = JsonToolStream(("add",))
    stream.push(out[2]["content"])
    deltas = stream.flush()
    assert [c["function"]["name"] for c in stream.calls] == ["add", "add"] and len(deltas) == 4
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 0, 1, 1]
    bad = JsonToolStream(("add",))
    bad.push('{"tool_calls": [{"name": "add", "arguments": {}}, {"name": "rm", "arguments": {}}]}')
    assert bad.flush() and bad.calls == []  # a call to a function not offered: the answer is text, no call is made up


def test_parallel_calls_only_when_the_request_asks() -> None:
    fmt = ToolFormat("generic")
    one = ChatCompletionRequest.model_validate({"model": "m", "tools": [CHAT_ADD], "messages": [{"role": "user", "content": "?"}]})
    many = one.model_copy(update={"parallel_tool_calls": True})
    assert one.parallel_tool_calls  # OpenAI's default, which the Hermes formats follow
    assert "`tool_call`" in generic_messages(one)[0]["content"] and "`tool_calls`" in generic_messages(many)[0]["content"]
    assert fmt.written_answer("Hi.", one) == '{"response": "Hi."}'
    assert ToolFormat("native").written_answer("Hi.", one) == "Hi."
