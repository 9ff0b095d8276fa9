"""Tool calling through the official openai client: rendered by the chat template, forced by a grammar, parsed into tool_calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.gateway.test_errors import assert_openai_error
from tests.helpers import SMOL, Tenancy, openai_client

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
READ = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file.",
        "parameters": {
            "type": "object",
            "properties": {
                "url": {"type": "string", "format": "uri", "maxLength": 20000},
                "offset": {"type": "integer", "minimum": 0},
                "labels": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "string"}},
            },
            "required": ["url"],
            "additionalProperties": False,
        },
    },
}
"""Keywords Claude Code's tools carry that no grammar rule enforces (``minimum``, ``propertyNames``, ``format: uri``, a long ``maxLength``)."""


def args_of(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_keywords_the_grammar_cannot_enforce_are_hints_and_the_call_is_served(smol_tools_pool) -> None:
    client = openai_client(smol_tools_pool)
    ask = [{"role": "user", "content": "Read the file at file:///etc/hosts."}]
    r = client.chat.completions.create(model=SMOL, messages=ask, tools=[READ], tool_choice="required", temperature=0, max_tokens=150)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for call in calls:
        args = json.loads(call.function.arguments)
        assert call.function.name == "read_file" and isinstance(args["url"], str) and set(args) <= {"url", "offset", "labels"}


def test_a_required_tool_choice_gives_a_valid_call(smol_tools_pool) -> None:
    client = openai_client(smol_tools_pool)
    r = client.chat.completions.create(
        model=SMOL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    tool = WEATHER if call.function.name == "get_weather" else TIME
    assert "paris" in args_of(call, tool)["city"].lower()


def test_a_named_tool_choice_calls_that_function_and_the_answer_goes_back(smol_tools_pool) -> None:
    client = openai_client(smol_tools_pool)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=SMOL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, temperature=0, max_tokens=80)
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_time" for c in calls)
    args_of(calls[0], TIME)

    # The call and its result go back as messages; the next turn renders them with the template.
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": "It is 14:05."} for c in calls),
    ]
    after = client.chat.completions.create(model=SMOL, messages=history, tools=[WEATHER, TIME], temperature=0, max_tokens=30)
    assert after.choices[0].message.content
    assert after.usage.prompt_tokens_details.cached_tokens > 0  # the tools and the question are a shared prefix


def test_a_streamed_tool_call_comes_as_openai_deltas(smol_tools_pool) -> None:
    client = openai_client(smol_tools_pool)
    kwargs = dict(
        model=SMOL, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80
    )
    whole = client.chat.completions.create(**kwargs)
    deltas, finish = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)


def test_auto_and_none_leave_the_choice_to_the_model(smol_tools_pool) -> None:
    client = openai_client(smol_tools_pool)
    greet = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=SMOL, messages=greet, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=20)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    auto = client.chat.completions.create(model=SMOL, messages=greet, tools=[WEATHER], temperature=0, max_tokens=60)
    message = auto.choices[0].message
    assert (message.tool_calls is not None) == (auto.choices[0].finish_reason == "tool_calls")
    assert "<tool_call>" not in (message.content or "") or message.tool_calls is None


def test_the_default_model_gets_tools_without_a_template_of_its_own(smol_pool) -> None:
    """SmolLM2's template is ChatML without tools: a request with tools is rendered in kvpool's Hermes template."""
    client = openai_client(smol_pool)
    r = client.chat.completions.create(model=SMOL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=80)
    assert r.choices[0].finish_reason == "tool_calls"
    assert "paris" in args_of(r.choices[0].message.tool_calls[0], WEATHER)["city"].lower()
    auto = client.chat.completions.create(model=SMOL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=40)
    assert auto.choices[0].message.content or auto.choices[0].message.tool_calls
    # Without tools, the model's own template renders the prompt, to the token (its own default system turn).
    plain = smol_pool.post("/tokenize", json={"content": SMOL_PROMPT.format(question=ASK[0]["content"])}).json()["tokens"]
    usage = client.chat.completions.create(model=SMOL, messages=ASK, max_tokens=1).usage
    assert usage.prompt_tokens == len(plain)


SMOL_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
)
ZEPHYR = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""A template that is not ChatML and renders no tools: such a model gets the generic JSON format."""


@pytest.fixture
def smol_generic_pool(smol_shared, tmp_path) -> Tenancy:
    template = tmp_path / "zephyr.jinja"
    template.write_text(ZEPHYR)
    return smol_shared.tenancy(template)


def test_a_template_neither_chatml_nor_with_tools_gets_the_generic_json_format(smol_generic_pool) -> None:
    client = openai_client(smol_generic_pool)
    kwargs = dict(model=SMOL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=80)
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    [call] = r.choices[0].message.tool_calls
    assert "paris" in args_of(call, WEATHER)["city"].lower()

    deltas = [d for chunk in client.chat.completions.create(**kwargs, stream=True) for c in chunk.choices for d in c.delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and json.loads(deltas[1].function.arguments) == json.loads(call.function.arguments)

    # auto: the grammar lets the model answer or call; either way the JSON never reaches the client.
    auto = client.chat.completions.create(model=SMOL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80)
    message = auto.choices[0].message
    assert message.tool_calls or (message.content and not message.content.startswith("{"))

    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."},
    ]
    after = client.chat.completions.create(model=SMOL, messages=history, tools=[WEATHER], temperature=0, max_tokens=60)
    assert after.choices[0].message.content or after.choices[0].message.tool_calls
    assert after.usage.prompt_tokens_details.cached_tokens > 0  # the tools and the question are a shared prefix


BAD = [
    (
        "unknown function in tool_choice",
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}},
        ["launch", "get_weather"],
    ),
    ("tool_choice without tools", {"tool_choice": "required"}, ["tool_choice"]),
    ("tool_choice of a wrong kind", {"tools": [WEATHER], "tool_choice": "always"}, ["tool_choice"]),
    ("tools is not a list", {"tools": {"type": "function"}}, ["tools"]),
    ("a tool without a function", {"tools": [{"type": "function"}]}, ["tools.0.function"]),
    ("a bad function name", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, ["name"]),
    ("duplicate function names", {"tools": [WEATHER, WEATHER]}, ["unique"]),
    ("parallel_tool_calls is text", {"tools": [WEATHER], "parallel_tool_calls": "yes"}, ["parallel_tool_calls"]),
    (
        "strict parameters the grammar cannot enforce",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "strict": True,
                        "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        ["tools.0.function.parameters.properties.n.minimum"],
    ),
    (
        "a forced call with a JSON response_format",
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        ["response_format"],
    ),
    ("a tool message without tool_call_id", {"messages": [{"role": "tool", "content": "x"}]}, ["tool_call_id"]),
    (
        "tool_calls on a user message",
        {
            "messages": [
                {"role": "user", "content": "x", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}
            ]
        },
        ["assistant"],
    ),
    (
        "arguments that are not JSON",
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}],
                },
                {"role": "tool", "tool_call_id": "c", "content": "x"},
            ]
        },
        ["arguments"],
    ),
    ("too many tools", {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, ["tools"]),
]


@pytest.mark.parametrize("extra,needles", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_tool_requests_are_400(smol_tools_pool, extra: dict, needles: list[str]) -> None:
    body = {"model": SMOL, "messages": ASK, "max_tokens": 4, **extra}
    assert_openai_error(smol_tools_pool.post("/v1/chat/completions", json=body), 400, *needles)
