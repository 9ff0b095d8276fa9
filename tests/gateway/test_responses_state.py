"""Stored responses in a real Redis: exact token ids, per tenant, within a time to live and a byte budget."""

from __future__ import annotations

import time

import redis

from gateway.responses_api.state import TENANT_RESPONSES_PREFIX, ResponseState, Stored
from gateway.tenants import Tenant

A = Tenant("team-a", "a" * 32)
B = Tenant("team-b", "b" * 32)


def stored(rid: str, n_tokens: int = 100) -> Stored:
    return Stored(
        response={"id": rid, "object": "response", "output": [{"type": "message", "content": []}]},
        items=[{"id": f"msg_{rid}", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        tokens=[(i * 7919) % 49152 for i in range(n_tokens)],
        n_prompt=n_tokens - 3,
        render_key="k" * 32,
    )


def test_a_response_keeps_its_token_ids_and_items_exactly(redis_url) -> None:
    state = ResponseState(redis.Redis.from_url(redis_url), 3600, 1 << 20)
    s = Stored(**{**stored("resp_1").__dict__, "tokens": [0, 1, 49151, 2**31 - 1]})
    state.put(A, s)
    assert state.get(A, "resp_1") == s
    assert state.get(A, "resp_1").history == [*s.items, *s.response["output"]]


def test_one_tenant_never_finds_anothers(redis_url) -> None:
    state = ResponseState(redis.Redis.from_url(redis_url), 3600, 1 << 20)
    state.put(A, stored("resp_1"))
    assert state.get(B, "resp_1") is None
    state.put(B, stored("resp_1", 50))
    assert len(state.get(A, "resp_1").tokens) == 100 and len(state.get(B, "resp_1").tokens) == 50


def test_the_oldest_responses_give_way_to_the_tenants_byte_budget(redis_url) -> None:
    conn = redis.Redis.from_url(redis_url)
    probe = ResponseState(conn, 3600, 1 << 30)
    probe.put(B, stored("resp_9"))
    size = int(conn.hget(f"{TENANT_RESPONSES_PREFIX}{B.salt[:24]}:bytes", "resp_9"))
    state = ResponseState(conn, 3600, 3 * size + size // 2)  # room for three
    dropped = [state.put(A, stored(f"resp_{i}")) for i in range(5)]
    assert dropped == [0, 0, 0, 1, 1]
    assert [state.get(A, f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert int(conn.hget(f"{TENANT_RESPONSES_PREFIX}{A.salt[:24]}:bytes", "")) == 3 * size
    assert state.get(B, "resp_9") is not None  # another tenant's budget is its own
    state.delete(A, "resp_4")
    assert int(conn.hget(f"{TENANT_RESPONSES_PREFIX}{A.salt[:24]}:bytes", "")) == 2 * size


def test_a_response_expires_after_its_time_to_live(redis_url) -> None:
    conn = redis.Redis.from_url(redis_url)
    state = ResponseState(conn, 1, 1 << 20)
    state.put(A, stored("resp_old"))
    deadline = time.monotonic() + 10
    while state.get(A, "resp_old") is not None:
        assert time.monotonic() < deadline, "the response outlived its time to live"
        time.sleep(0.05)
    state.put(A, stored("resp_new"))  # storing forgets the expired one's accounting too
    assert conn.zrange(f"{TENANT_RESPONSES_PREFIX}{A.salt[:24]}", 0, -1) == [b"resp_new"]
