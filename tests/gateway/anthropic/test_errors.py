"""Bad input and bad days on the Messages API: Anthropic's error shape, a 4xx naming the field, keys as Anthropic's clients send them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from gateway.pool.procs import GatewayProcess, free_port
from tests.helpers import MODEL, Pool, running_pool

KEYS = {"sk-a": "team-a", "sk-b": "team-b"}
AUTH = {"x-api-key": "sk-a"}
USER = [{"role": "user", "content": "hello"}]
OK = {"model": MODEL, "max_tokens": 4, "messages": USER}


@pytest.fixture(scope="module")
def tiny_pool(redis_server, s3_server, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """The generated tiny model (answers do not matter here), with API keys and a 64 KiB body limit."""
    logs = tmp_path_factory.mktemp("messages-errors")
    env = {"KVPOOL_API_KEYS": json.dumps(KEYS), "KVPOOL_TENANT_SECRET": "s", "KVPOOL_MAX_BODY_BYTES": "65536"}
    with running_pool(redis_server, s3_server, tiny_model, logs, ["tiny-1"], **env) as pool:
        yield pool


def assert_anthropic_error(r: httpx.Response, status: int, kind: str, *needles: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    for n in needles:
        assert n in body["error"]["message"], body["error"]["message"]
    return body["error"]["message"]


def tool_use(id_: str) -> dict:
    return {"type": "tool_use", "id": id_, "name": "f", "input": {}}


BAD = [
    ("not json", b"{not json", ["not valid JSON"]),
    ("no max_tokens", {"model": MODEL, "messages": USER}, ["max_tokens", "required"]),
    ("max_tokens is text", {**OK, "max_tokens": "4"}, ["max_tokens"]),
    ("no messages", {**OK, "messages": []}, ["messages"]),
    ("a role that is not one", {**OK, "messages": [{"role": "tool", "content": "x"}]}, ["messages.0.role"]),
    ("a text block without text", {**OK, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, ["messages.0.content.0.text"]),
    ("a block of an unknown type", {**OK, "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, ["messages.0.content.0", "video"]),
    (
        "an image block",
        {**OK, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
        ["messages.0.content.0.type", "image", "not supported"],
    ),
    ("no content blocks", {**OK, "messages": [{"role": "user", "content": []}]}, ["messages.0.content"]),
    (
        "a tool_result for an unknown tool_use_id",
        {
            **OK,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [tool_use("toolu_1")]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "4"}]},
            ],
        },
        ["messages.2.content.0.tool_use_id", "toolu_2"],
    ),
    ("a tool_use in a user message", {**OK, "messages": [{"role": "user", "content": [tool_use("toolu_1")]}]}, ["messages.0.content.0", "assistant"]),
    ("a tool_use without input", {**OK, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]}, ["messages.1.content.0.input"]),
    ("a cache_control ttl of 10m", {**OK, "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "10m"}}]}, ["system.0.cache_control.ttl"]),
    ("five cache_control marks", {**OK, "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}] * 5}, ["at most 4"]),
    ("temperature 1.5", {**OK, "temperature": 1.5}, ["temperature"]),
    ("top_k negative", {**OK, "top_k": -1}, ["top_k"]),
    ("a tool without input_schema", {**OK, "tools": [{"name": "f"}]}, ["tools.0.input_schema"]),
    ("a bad tool name", {**OK, "tools": [{"name": "f g", "input_schema": {"type": "object"}}]}, ["tools.0.name"]),
    ("a server tool", {**OK, "tools": [{"name": "web_search", "type": "web_search_20250305", "input_schema": {}}]}, ["tools.0.type", "server tools"]),
    ("a server tool as sent", {**OK, "tools": [{"name": "web_search", "type": "web_search_20250305", "max_uses": 5}]}, ["tools.0.type", "web_search_20250305"]),
    ("tool_choice naming no tool", {**OK, "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}}, ["tool_choice.name", "'g'"]),
    ("tool_choice of an unknown type", {**OK, "tool_choice": {"type": "always"}}, ["tool_choice"]),
    ("a strict schema the grammar cannot enforce", {**OK, "tools": [{"name": "f", "strict": True, "input_schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}}], "tool_choice": {"type": "any"}}, ["tools.0.input_schema.properties.n.minimum"]),
    ("stop_sequences is a string", {**OK, "stop_sequences": "x"}, ["stop_sequences"]),
    ("a lone surrogate", b'{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "a \\ud800"}]}' % MODEL.encode(), ["surrogate"]),
    ("a prompt longer than the context", {**OK, "messages": [{"role": "user", "content": "lantern " * 3000}]}, ["prompt is too long", "2047"]),
]  # fmt: skip


@pytest.mark.parametrize("body,needles", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_messages_are_400_in_anthropics_shape(tiny_pool: Pool, body, needles: list[str]) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "content-type": "application/json"}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        if path.endswith("count_tokens") and isinstance(body, dict) and "max_tokens" not in body:
            continue  # counting tokens needs no max_tokens
        r = httpx.post(tiny_pool.gateway.url + path, content=content, headers=headers, timeout=60)
        if path.endswith("count_tokens") and r.status_code == 200:
            continue  # what only a message can get wrong (sampling, length)
        assert_anthropic_error(r, 400, "invalid_request_error", *needles)


def test_an_unknown_model_is_404_and_the_client_raises_its_own_errors(tiny_pool: Pool) -> None:
    r = httpx.post(tiny_pool.gateway.url + "/v1/messages", json={**OK, "model": "claude-opus-9"}, headers=AUTH)
    assert_anthropic_error(r, 404, "not_found_error", "claude-opus-9")
    client = tiny_pool.client(api_key="sk-a")
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [{"type": "text"}]}])  # type: ignore[typeddict-item]
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_keys_come_as_x_api_key_or_bearer_and_name_the_tenant(tiny_pool: Pool) -> None:
    url = tiny_pool.gateway.url + "/v1/messages"
    assert_anthropic_error(httpx.post(url, json=OK), 401, "authentication_error", "x-api-key")
    assert_anthropic_error(httpx.post(url, json=OK, headers={"x-api-key": "sk-z"}), 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        tiny_pool.client(api_key="sk-z").messages.create(**OK)

    body = {**OK, "messages": [{"role": "user", "content": "the same words, twice, for one tenant " * 8}]}
    a = tiny_pool.client(api_key="sk-a")
    first = a.messages.create(**body)
    assert a.messages.create(**body).usage.cache_read_input_tokens > 0
    b = anthropic.Anthropic(base_url=tiny_pool.gateway.url, auth_token="sk-b", api_key=None, max_retries=0)  # Authorization: Bearer
    other = b.messages.create(**body)
    assert other.usage.cache_read_input_tokens == 0 < first.usage.input_tokens  # tenants never share a cache


def test_a_body_over_the_limit_is_413_request_too_large(tiny_pool: Pool) -> None:
    big = {**OK, "messages": [{"role": "user", "content": "x" * 70_000}]}
    r = httpx.post(tiny_pool.gateway.url + "/v1/messages", json=big, headers=AUTH)
    assert_anthropic_error(r, 413, "request_too_large", "65536")


def test_no_live_worker_is_529_overloaded(tiny_pool: Pool) -> None:
    """A Redis database no worker ever served is a pool starting: 529 once the wait for its first worker ends."""
    env = {**tiny_pool.env, "KVPOOL_REDIS_URL": tiny_pool.redis_url.rsplit("/", 1)[0] + "/1", "KVPOOL_START_WAIT_S": "1"}
    gw = GatewayProcess(env, free_port(), tiny_pool.logs / "gateway-alone.log").start()
    try:
        r = httpx.post(gw.url + "/v1/messages", json=OK, headers=AUTH)
        assert_anthropic_error(r, 529, "overloaded_error", "no live worker", "starting")
        assert r.headers["retry-after"]
    finally:
        gw.stop()
