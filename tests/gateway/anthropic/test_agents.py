"""What coding agents send to ``/v1/messages``, served as they send it: Claude Code's billing header, its tool schemas, its usage.

On the real model through the official anthropic client.
"""

from __future__ import annotations

import openai

from tests.helpers import SMOL, Pool, prompt_text

GREEDY = {"extra_body": {"temperature": 0}}
RULES = "You are a coding agent in a terminal. Follow the house rules. " + prompt_text(3, 300)


def billed(first_prompt_hash: str) -> str:
    """The block Claude Code puts first in its system prompt: its suffix changes with the session's first prompt."""
    return f"x-anthropic-billing-header: cc_version=2.1.197.{first_prompt_hash}; cc_entrypoint=sdk-cli;"


def test_claude_codes_billing_header_is_no_part_of_the_prompt(smol_messages: Pool) -> None:
    client = smol_messages.client()
    ask = [{"role": "user", "content": "Say hello."}]
    plain = client.messages.count_tokens(model=SMOL, system=[{"type": "text", "text": RULES}], messages=ask).input_tokens
    for first in ("1c0", "9fe"):
        blocks = [{"type": "text", "text": billed(first)}, {"type": "text", "text": RULES}]
        assert client.messages.count_tokens(model=SMOL, system=blocks, messages=ask).input_tokens == plain
        as_text = billed(first) + "\n" + RULES
        assert client.messages.count_tokens(model=SMOL, system=as_text, messages=ask).input_tokens == plain


def test_sessions_with_different_first_prompts_share_their_prefix(smol_messages: Pool) -> None:
    client = smol_messages.client()

    def session(first: str, prompt: str):  # type: ignore[no-untyped-def]
        system = [{"type": "text", "text": billed(first)}, {"type": "text", "text": RULES, "cache_control": {"type": "ephemeral"}}]
        return client.messages.create(model=SMOL, max_tokens=4, system=system, messages=[{"role": "user", "content": prompt}], **GREEDY)

    one = session("1c0", "List three colours.")
    two = session("77f", "What is a monad?")
    rules = client.messages.count_tokens(model=SMOL, system=RULES, messages=[{"role": "user", "content": "?"}]).input_tokens
    assert one.usage.cache_read_input_tokens == 0
    assert two.usage.cache_read_input_tokens >= rules - 10  # all of the system prompt but its last tokens


CLAUDE_CODE_READ = {
    "name": "Read",
    "description": "Reads a file from the local filesystem.",
    "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "file_path": {"type": "string", "description": "The absolute path to the file to read"},
            "offset": {"type": "integer", "minimum": 0, "maximum": 9007199254740991},
            "limit": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9007199254740991},
        },
        "required": ["file_path"],
        "additionalProperties": False,
    },
}
CLAUDE_CODE_WEBFETCH = {
    "name": "WebFetch",
    "description": "Fetches a URL.",
    "input_schema": {
        "type": "object",
        "properties": {"url": {"type": "string", "format": "uri"}, "prompt": {"type": "string", "maxLength": 100000}},
        "required": ["url", "prompt"],
        "additionalProperties": False,
    },
}
CLAUDE_CODE_TASK = {
    "name": "TaskCreate",
    "description": "Creates a task.",
    "input_schema": {
        "type": "object",
        "properties": {
            "subject": {"type": "string"},
            "metadata": {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {}},
        },
        "required": ["subject"],
    },
}


def test_tool_schemas_are_hints_so_claude_codes_tools_are_served(smol_messages: Pool) -> None:
    client = smol_messages.client()
    tools = [CLAUDE_CODE_READ, CLAUDE_CODE_WEBFETCH, CLAUDE_CODE_TASK]
    ask = [{"role": "user", "content": "Read the file /etc/hosts."}]
    r = client.messages.create(model=SMOL, max_tokens=60, messages=ask, tools=tools, **GREEDY)  # type: ignore[arg-type]
    assert r.stop_reason in ("end_turn", "tool_use", "max_tokens")
    forced = client.messages.create(
        model=SMOL,
        max_tokens=100,
        messages=ask,
        tools=tools,
        tool_choice={"type": "tool", "name": "Read"},
        **GREEDY,  # type: ignore[arg-type]
    )
    [call] = [b for b in forced.content if b.type == "tool_use"]
    assert call.name == "Read" and isinstance(call.input["file_path"], str)  # type: ignore[index]


def test_a_stream_starts_with_no_input_it_cannot_know_yet_and_ends_with_anthropics_usage(smol_messages: Pool) -> None:
    """``input_tokens`` is the part read from no cache; ``message_start`` comes before the worker knows what it reuses."""
    client = smol_messages.client()
    system = "Be brief. " + prompt_text(5, 200)
    ask = [{"role": "user", "content": "Say hello."}]
    counted = client.messages.count_tokens(model=SMOL, system=system, messages=ask).input_tokens
    client.messages.create(model=SMOL, max_tokens=3, system=system, messages=ask, **GREEDY)
    events = list(client.messages.create(model=SMOL, max_tokens=3, system=system, messages=ask, stream=True, **GREEDY))
    start, delta = events[0].message.usage, next(e for e in events if e.type == "message_delta").usage  # type: ignore[union-attr]
    assert delta.cache_read_input_tokens and delta.cache_read_input_tokens > counted // 2  # the same prompt again: read
    assert delta.input_tokens + delta.cache_read_input_tokens + (delta.cache_creation_input_tokens or 0) == counted
    assert start.input_tokens <= delta.input_tokens  # never the whole prompt, which agents would add to their totals


def test_max_tokens_beyond_the_context_is_what_is_left_of_it_in_every_api(smol_messages: Pool) -> None:
    """Agents ask for 32,000 tokens whatever the model; llama-server clamps that to the context, and so does kvpool."""
    chat = openai.OpenAI(base_url=smol_messages.gateway.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    hello = [{"role": "user", "content": "Say hello."}]
    r = chat.chat.completions.create(model=SMOL, messages=hello, max_tokens=32_000, temperature=0)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens + r.usage.completion_tokens <= 4096  # type: ignore[union-attr]
    done = chat.responses.create(model=SMOL, input="Say hello.", max_output_tokens=32_000, temperature=0)
    assert done.status in ("completed", "incomplete") and done.usage.input_tokens + done.usage.output_tokens <= 4096  # type: ignore[union-attr]
    for huge in (32_000, 10**9):  # one rule on every endpoint, whatever the size: never a 400
        c = chat.completions.create(model=SMOL, prompt="Say hello.", max_tokens=huge, temperature=0, stop=[".", "\n"])
        assert c.choices[0].finish_reason in ("stop", "length") and c.usage.prompt_tokens + c.usage.completion_tokens <= 4096  # type: ignore[union-attr]
        r = chat.chat.completions.create(model=SMOL, messages=hello, max_tokens=huge, temperature=0)  # type: ignore[arg-type]
        assert r.choices[0].finish_reason in ("stop", "length")
