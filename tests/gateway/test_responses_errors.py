"""The Responses API refuses what it cannot do, in OpenAI's error shape with a 4xx naming the field; tenants never meet."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.gateway.responses_pool import Pool, responses_pool
from tests.gateway.test_errors import assert_openai_error
from tests.helpers import SMOL, prompt_text

A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
STRICT_MINIMUM = {
    "type": "function",
    "strict": True,
    "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}},
}


@pytest.fixture(scope="module")
def pool(redis_server, s3_server, smollm2, tmp_path_factory) -> Iterator[Pool]:
    with responses_pool(redis_server, s3_server, smollm2, tmp_path_factory.mktemp("responses-errors"), workers=1) as p:
        yield p


@pytest.fixture(scope="module")
def stored(pool) -> str:
    """A response of tenant A's."""
    return pool.client().responses.create(model=SMOL, input="Say yes.", temperature=0, max_output_tokens=4).id


BAD = [
    ({"input": 5}, 400, "input", "input"),
    ({"input": []}, 400, "input", "at least one item"),
    ({"input": [{"role": "user"}]}, 400, "input", "input.0.content"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input", "input.0.role"),
    ({"input": [{"content": "hi"}]}, 400, "input", "input.0.type"),
    ({"input": [{"type": "banana"}]}, 400, "input", "unknown item type 'banana'"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input", "input.0.type: reasoning items are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input", "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400, "input", "input.0.content"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]}, 400, "input", "input.0.call_id"),
    ({"input": [{**CALL, "arguments": "{not json"}]}, 400, "input", "input.0.arguments"),
    ({"input": [{**CALL, "name": "no spaces allowed"}]}, 400, "input", "input.0.name"),
    ({"previous_response_id": "resp_nope"}, 400, "previous_response_id", "Previous response with id 'resp_nope' not found"),
    ({"tools": [{"type": "teleport"}]}, 400, "tools", "tools.0.type"),
    (
        {
            "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "a"}, {**STRICT_MINIMUM, "name": "b"}]}],
            "tool_choice": "required",
        },
        400,
        "tools",
        "tools.0.tools.1.parameters.properties.n.minimum",
    ),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]}, 400, "tools", "tools.0.tools.0.type"),
    ({"tools": [{"type": "function", "name": "a b"}]}, 400, "tools", "tools.0.name"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, 400, "tools", "unique"),
    ({"tool_choice": "required"}, 400, "tool_choice", "tool_choice needs tools"),
    ({"tool_choice": {"type": "file_search"}}, 400, "tool_choice", "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, 400, "tool_choice", "'g'"),
    ({"text": {"format": {"type": "json_schema"}}}, 400, "text", "needs a name and a schema"),
    (
        {"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "integer", "minimum": 3}, "strict": True}}},
        400,
        "text",
        "text.format.schema.minimum",
    ),
    ({"text": {"format": {"type": "xml"}}}, 400, "text", "text.format.type"),
    ({"truncation": "auto"}, 400, "truncation", "truncation"),
    ({"background": True}, 400, "background", "background"),
    ({"conversation": "conv_1"}, 400, "conversation", "previous_response_id"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens"),
    ({"temperature": 3}, 400, "temperature", "temperature"),
    ({"metadata": {str(i): "x" for i in range(17)}}, 400, "metadata", "metadata"),
    ({"input": "\ud800"}, 400, None, "lone UTF-16 surrogate"),
    ({"input": prompt_text(5, 2500)}, 400, "input", "context of 2048"),
    ({"model": "gpt-4o"}, 404, "model", "gpt-4o"),
]


@pytest.mark.parametrize(("change", "status", "param", "needle"), BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_bad_requests_are_openai_errors_naming_the_field(pool, change, status, param, needle) -> None:
    body = json.dumps({"model": SMOL, "input": "hello", **change})  # ASCII, so that a lone surrogate travels as JSON allows
    r = httpx.post(pool.url + "/v1/responses", content=body, headers={**A, "Content-Type": "application/json"}, timeout=60)
    err = assert_openai_error(r, status, needle)
    assert err["param"] == param


def test_a_body_beyond_the_limit_is_413(pool) -> None:
    body = {"model": SMOL, "input": "x" * (1 << 20)}
    assert_openai_error(httpx.post(pool.url + "/v1/responses", json=body, headers=A, timeout=60), 413, "exceeds the limit")


def test_another_tenants_response_is_not_found(pool, stored) -> None:
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items")):
        r = httpx.request(method, f"{pool.url}/v1/responses/{stored}{path}", headers=B)
        assert assert_openai_error(r, 404, stored)["type"] == "invalid_request_error"
    follow = {"model": SMOL, "input": "And?", "previous_response_id": stored}
    err = assert_openai_error(httpx.post(pool.url + "/v1/responses", json=follow, headers=B, timeout=60), 400, "not found")
    assert err["param"] == "previous_response_id" and err["code"] == "previous_response_not_found"
    assert pool.client("key-a").responses.retrieve(stored).id == stored  # still there for its own tenant
    assert_openai_error(httpx.get(f"{pool.url}/v1/responses/{stored}"), 401, "API key")


def test_a_response_with_store_false_is_not_kept(pool) -> None:
    client = pool.client()
    r = client.responses.create(model=SMOL, input="Say no.", store=False, temperature=0, max_output_tokens=4)
    assert r.store is False and r.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model=SMOL, input="And?", previous_response_id=r.id, max_output_tokens=4)


def test_a_deleted_response_is_gone(pool) -> None:
    client = pool.client()
    r = client.responses.create(model=SMOL, input="Say maybe.", temperature=0, max_output_tokens=4)
    gone = httpx.delete(f"{pool.url}/v1/responses/{r.id}", headers=A).json()
    assert gone == {"id": r.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_bad_listing_cursors_are_400(pool, stored) -> None:
    url = f"{pool.url}/v1/responses/{stored}/input_items"
    assert assert_openai_error(httpx.get(url, params={"after": "msg_nope"}, headers=A), 400, "msg_nope")["param"] == "after"
    assert_openai_error(httpx.get(url, params={"limit": 0}, headers=A), 400, "limit")
    assert_openai_error(httpx.get(url, params={"order": "sideways"}, headers=A), 400, "order")
    assert_openai_error(httpx.get(f"{pool.url}/v1/responses/{stored}", params={"stream": "true"}, headers=A), 400, "stream")
