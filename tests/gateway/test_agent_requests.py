"""Coding agents' own requests, replayed: bodies captured from Claude Code and Codex (installed from npm, default settings).

Each body (``tests/gateway/agents/``, how they were captured is in its README) is checked
against the official SDK's request type, sent to a gateway as the agent sent it (only
the model's name and the answer's length changed), and its answer read back through the
SDK's response types. The replays run on a random-weight model with SmolLM2's tokenizer
and chat template (`worker.models.borrow`): the gateway renders and tokenizes each
prompt exactly as for SmolLM2 (its generic tool format included) and a real worker
evaluates all of it with llama.cpp, in seconds rather than minutes; what is checked is
the answers' shapes, statuses and cache, not their text. Then the shapes only Codex
sends, where the text matters, on SmolLM2 itself: ``namespace`` tools, built-in tools
kvpool cannot run, and a tool output without ``call_id``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic.types
import httpx
import openai.types.responses
import pytest
from anthropic.types.beta.message_create_params import MessageCreateParams
from openai.types.responses.response_create_params import ResponseCreateParams
from pydantic import TypeAdapter

from tests.helpers import SMOL, THREADS, Pool, private_pool, running_pool
from worker.models.synth import make_model

pytestmark = pytest.mark.timeout(600)
AGENTS = Path(__file__).parent / "agents"
CLAUDE_CODE = AGENTS / "claude-code-2.1.197-first-request.json"
CODEX = AGENTS / "codex-0.171.0-first-request.json"
CODEX_AFTER_CALLS = AGENTS / "codex-0.171.0-second-request.json"
"""Codex's next turn: the model had called ``send_input`` of the ``multi_agent_v1`` namespace four times; the calls come back
with their namespace, and each output with its ``call_id``."""


REPLAY = "SmolLM2-tokenizer.tiny-long"
"""The replays' model: ``tiny-long`` (one layer of width 64: a 24,000-token prompt evaluates in about ten seconds on two
cores) speaking SmolLM2's tokenizer and chat template."""


@pytest.fixture(scope="module")
def replay_pool(redis_server, s3_server, smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """A pool whose prompts are SmolLM2's, token for token, with a context that holds an agent's prompt."""
    model = make_model("tiny-long", tmp_path_factory.mktemp("models") / f"{REPLAY}.gguf", tokenizer_from=smollm2)
    with running_pool(
        redis_server,
        s3_server,
        model,
        tmp_path_factory.mktemp("agents"),
        ["replay-1"],
        KVPOOL_N_CTX="32768",
        KVPOOL_N_THREADS=str(THREADS),  # every core this test process has: these prompts are the suite's longest
    ) as pool:
        yield pool


@pytest.fixture(scope="module")
def agents_pool(s3_server, smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """SmolLM2 as it ships (its own template: the generic tool format), on a Redis of its own beside the replays' pool."""
    with private_pool(s3_server, smollm2, tmp_path_factory.mktemp("smol"), ["smol-1"]) as pool:
        yield pool


def events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line[6:] != "[DONE]"]


def test_claude_codes_first_request_is_served_as_it_sends_it(replay_pool: Pool) -> None:
    body = json.loads(CLAUDE_CODE.read_text())
    TypeAdapter(MessageCreateParams).validate_python(body)
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header:") and len(body["tools"]) >= 20
    body = {**body, "model": REPLAY, "max_tokens": 4}
    with httpx.stream("POST", replay_pool.gateway.url + "/v1/messages?beta=true", json=body, headers={"x-api-key": "x"}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        sent = [e for e in events(r) if e["type"] != "ping"]  # pings keep the stream alive; the SDK drops them
    stream = TypeAdapter(list[anthropic.types.RawMessageStreamEvent]).validate_python(sent)
    assert stream[0].type == "message_start" and stream[-1].type == "message_stop"
    [delta] = [e for e in stream if e.type == "message_delta"]
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 4

    again = httpx.post(replay_pool.gateway.url + "/v1/messages?beta=true", json={**body, "stream": False}, timeout=300)
    message = anthropic.types.Message.model_validate(again.json())
    assert message.usage.cache_read_input_tokens and message.usage.cache_read_input_tokens > 0.9 * (
        message.usage.cache_read_input_tokens + message.usage.input_tokens
    )


def test_codexs_first_request_is_served_as_it_sends_it(replay_pool: Pool) -> None:
    body = json.loads(CODEX.read_text())
    TypeAdapter(ResponseCreateParams).validate_python(body)
    kinds = [t["type"] for t in body["tools"]]
    assert "namespace" in kinds and "web_search" in kinds
    body = {**body, "model": REPLAY, "max_output_tokens": 4}
    with httpx.stream("POST", replay_pool.gateway.url + "/v1/responses", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        sent = events(r)
    stream = TypeAdapter(list[openai.types.responses.ResponseStreamEvent]).validate_python(sent)
    assert stream[0].type == "response.created" and stream[-1].type in ("response.completed", "response.incomplete")
    final = sent[-1]["response"]
    assert final["kvpool"]["tools_left_out"] == ["web_search"]  # the response says what the prompt left out
    openai.types.responses.Response.model_validate(final)

    after = json.loads(CODEX_AFTER_CALLS.read_text())
    TypeAdapter(ResponseCreateParams).validate_python(after)
    assert {i.get("namespace") for i in after["input"] if i["type"] == "function_call"} == {"multi_agent_v1"}
    r = httpx.post(
        replay_pool.gateway.url + "/v1/responses", json={**after, "model": REPLAY, "max_output_tokens": 4, "stream": False}, timeout=300
    )
    assert r.status_code == 200, r.text
    usage = openai.types.responses.Response.model_validate(r.json()).usage
    assert usage is not None and usage.input_tokens_details.cached_tokens > 0.8 * usage.input_tokens  # the first turn's prefix


SPAWN = {
    "type": "function",
    "name": "spawn_agent",
    "description": "Spawn a sub-agent for a task.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"task": {"type": "string", "maxLength": 40}}, "required": ["task"]},
}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.", "tools": [SPAWN]}


def test_a_namespace_tool_is_offered_as_its_functions_and_a_call_names_its_namespace(agents_pool: Pool) -> None:
    client = openai.OpenAI(base_url=agents_pool.gateway.url + "/v1", api_key="x", max_retries=0, timeout=300)
    r = client.responses.create(
        model=SMOL,
        input="Start a sub-agent that writes the tests.",
        tools=[NAMESPACE, {"type": "web_search"}],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "spawn_agent"},
        max_output_tokens=60,
        temperature=0,
    )
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "spawn_agent" and call.namespace == "multi_agent_v1"
    assert r.model_extra["kvpool"]["tools_left_out"] == ["web_search"]  # type: ignore[index]

    # Codex sends some outputs without call_id, naming the function (and namespace) instead: they answer its last call.
    output = {"type": "function_call_output", "name": "spawn_agent", "namespace": "multi_agent_v1", "output": "agent 7 started"}
    follow = client.responses.create(
        model=SMOL,
        previous_response_id=r.id,
        input=[output],  # type: ignore[list-item]
        tools=[NAMESPACE],  # type: ignore[list-item]
        max_output_tokens=8,
        temperature=0,
    )
    items = client.responses.input_items.list(follow.id).data
    [answered] = [i for i in items if i.type == "function_call_output"]
    assert answered.call_id == call.call_id  # type: ignore[union-attr]

    orphan = httpx.post(
        agents_pool.gateway.url + "/v1/responses",
        json={"model": SMOL, "input": [{"role": "user", "content": "hi"}, output], "max_output_tokens": 4},
        timeout=60,
    )
    assert orphan.status_code == 400 and "input.1.call_id" in orphan.json()["error"]["message"]


def test_a_tool_type_kvpool_does_not_know_is_400_naming_it(agents_pool: Pool) -> None:
    r = httpx.post(
        agents_pool.gateway.url + "/v1/responses",
        json={"model": SMOL, "input": "hi", "tools": [{"type": "teleport"}], "max_output_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 400 and "tools.0.type" in r.json()["error"]["message"]
