"""Stored responses: per tenant, in Redis, with a time to live and a byte budget.

A stored response is a Redis hash (`RESPONSE_PREFIX`): the response
object as the API returns it, the conversation's input items, the exact token ids of its
prompt and of its answer (little-endian int32), and the *render key* the prompt was made
under (model, chat template, instructions, tools). A follow-up that names it continues
from those token ids (`gateway.responses_api.prepare`).

Every tenant has its own key space (its salt is in every key), so another tenant's id is
simply not found. A tenant's responses are listed in a sorted set by creation time with
their sizes beside it; a store first forgets entries past their time to live, then adds
the new one, then drops the oldest until the tenant's total fits ``responses_max_bytes``.
All of it runs as one Lua script, so gateways storing at once never overshoot the budget.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from gateway.errors import InvalidRequest, NotFound
from gateway.tenants import Tenant

RESPONSE_PREFIX = "kvpool:response:"
"""``kvpool:response:<tenant>:<id>``: hash, a stored Responses API response: the object, its input items, its
prompt and answer token ids, its render key; expiring."""
TENANT_RESPONSES_PREFIX = "kvpool:responses:"
"""``kvpool:responses:<tenant>``: sorted set of a tenant's stored response ids by creation time; ``<tenant>:bytes``:
hash of their sizes (field ``""``: the total), for the tenant's byte budget."""


_PUT = """
local rec, zkey, skey = KEYS[1], KEYS[2], KEYS[3]
local id, ttl, budget, size, prefix = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local total = tonumber(redis.call('HGET', skey, '') or '0')
local function forget(old)
  total = total - tonumber(redis.call('HGET', skey, old) or '0')
  redis.call('HDEL', skey, old)
  redis.call('ZREM', zkey, old)
  redis.call('DEL', prefix .. old)
end
for _, old in ipairs(redis.call('ZRANGEBYSCORE', zkey, '-inf', now - ttl)) do forget(old) end
redis.call('HSET', rec, 'response', ARGV[6], 'items', ARGV[7], 'tokens', ARGV[8], 'meta', ARGV[9])
redis.call('EXPIRE', rec, ttl)
redis.call('ZADD', zkey, now, id)
redis.call('HSET', skey, id, size)
total = total + size
local dropped = 0
while total > budget do
  local oldest = redis.call('ZRANGE', zkey, 0, 0)[1]
  if oldest == nil or oldest == id then break end
  forget(oldest)
  dropped = dropped + 1
end
redis.call('HSET', skey, '', total)
redis.call('EXPIRE', zkey, ttl)
redis.call('EXPIRE', skey, ttl)
return dropped
"""

_DELETE = """
local rec, zkey, skey, id = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
if redis.call('DEL', rec) == 0 then return 0 end
local size = tonumber(redis.call('HGET', skey, id) or '0')
redis.call('HDEL', skey, id)
redis.call('ZREM', zkey, id)
redis.call('HSET', skey, '', tonumber(redis.call('HGET', skey, '') or '0') - size)
return 1
"""


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    items: list[dict[str, Any]]
    """The conversation's input items: every earlier turn's input and output, then this request's input."""
    tokens: list[int]
    """The prompt's token ids, then the answer's."""
    n_prompt: int
    render_key: str

    @property
    def history(self) -> list[dict[str, Any]]:
        """What a follow-up continues: the input items, then this response's output."""
        return [*self.items, *self.response["output"]]


def _tenant(tenant: Tenant) -> str:
    return tenant.salt[:24]


class ResponseState:
    def __init__(self, conn: redis.Redis[bytes], ttl_s: int, max_bytes: int) -> None:
        self.conn = conn
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._put = conn.register_script(_PUT)
        self._delete = conn.register_script(_DELETE)

    def _keys(self, tenant: Tenant, rid: str) -> list[str]:
        t = _tenant(tenant)
        return [f"{RESPONSE_PREFIX}{t}:{rid}", f"{TENANT_RESPONSES_PREFIX}{t}", f"{TENANT_RESPONSES_PREFIX}{t}:bytes"]

    def put(self, tenant: Tenant, s: Stored) -> int:
        """Store ``s`` under its response's id; returns how many of the tenant's oldest responses made way for it."""
        fields = [
            json.dumps(s.response),
            json.dumps(s.items),
            np.asarray(s.tokens, dtype="<i4").tobytes(),
            json.dumps({"n_prompt": s.n_prompt, "render_key": s.render_key}),
        ]
        size = sum(len(f) for f in fields)
        rid = s.response["id"]
        prefix = f"{RESPONSE_PREFIX}{_tenant(tenant)}:"
        return int(self._put(keys=self._keys(tenant, rid), args=[rid, self.ttl_s, self.max_bytes, size, prefix, *fields]))

    def get(self, tenant: Tenant, rid: str) -> Stored | None:
        raw = self.conn.hgetall(self._keys(tenant, rid)[0])
        if not raw:
            return None
        meta = json.loads(raw[b"meta"])
        return Stored(
            response=json.loads(raw[b"response"]),
            items=json.loads(raw[b"items"]),
            tokens=np.frombuffer(raw[b"tokens"], dtype="<i4").tolist(),
            n_prompt=int(meta["n_prompt"]),
            render_key=str(meta["render_key"]),
        )

    def need(self, tenant: Tenant, rid: str) -> Stored:
        """A stored response, or 404 (another tenant's id is not found either)."""
        s = self.get(tenant, rid)
        if s is None:
            raise NotFound(f"No response with id '{rid}' found.", param="response_id", code="not_found")
        return s

    def previous(self, tenant: Tenant, rid: str) -> Stored:
        """The response a follow-up names, or OpenAI's 400 ``previous_response_not_found``."""
        s = self.get(tenant, rid)
        if s is None:
            raise InvalidRequest(
                f"Previous response with id '{rid}' not found.", param="previous_response_id", code="previous_response_not_found"
            )
        return s

    def delete(self, tenant: Tenant, rid: str) -> None:
        if not int(self._delete(keys=self._keys(tenant, rid), args=[rid])):
            raise NotFound(f"No response with id '{rid}' found.", param="response_id", code="not_found")
