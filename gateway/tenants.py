"""API keys and tenants. A tenant's cache salt is derived on the server and never taken from the client.

Each tenant's salt enters the namespace of its chains, so tenants never share cache
entries, and one tenant cannot tell from timing whether another sent a prompt (the lesson
behind vLLM's ``cache_salt``). Keys configured for the same tenant share its cache.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass

from gateway.errors import Unauthorized

log = logging.getLogger("kvpool.gateway")

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Tenant:
    id: str
    salt: str


class Tenants:
    def __init__(self, api_keys: dict[str, str], secret: str) -> None:
        self.api_keys = dict(api_keys)
        self.secret = secret.encode()
        if not self.api_keys:
            log.warning("auth.disabled", extra={"reason": "no KVPOOL_API_KEYS configured: every request is tenant 'default'"})

    def salt(self, tenant_id: str) -> str:
        return hmac.new(self.secret, tenant_id.encode(), hashlib.sha256).hexdigest()[:32]

    def resolve(self, authorization: str | None) -> Tenant:
        if not self.api_keys:
            return Tenant(DEFAULT_TENANT, self.salt(DEFAULT_TENANT))
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        for known, tenant_id in self.api_keys.items():
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                return Tenant(tenant_id, self.salt(tenant_id))
        raise Unauthorized("incorrect API key", code="invalid_api_key")
