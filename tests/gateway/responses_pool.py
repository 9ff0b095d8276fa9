"""A pool for a whole test module of the Responses API: real Redis, S3 over HTTP, SmolLM2 workers and a gateway.

One pool per module (starting SmolLM2 workers takes seconds): the module's tests share it,
each with its own conversations. Two tenants hold API keys, so tests can check that one
tenant never sees another's responses. The gateway serves ChatML with tools
(`gateway/templates/chatml-tools.jinja`), so function tools work on SmolLM2.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import openai
import redis

from gateway.pool.procs import GatewayProcess, RedisServer, WorkerProcess, free_port, start_together
from gateway.pool.s3server import S3Server
from gateway.responses_api.state import ResponseState
from gateway.tenants import Tenants
from tests.helpers import POOL_CHUNK, TOOLS_TEMPLATE, env_for_pool, s3_settings

KEYS = {"key-a": "team-a", "key-b": "team-b"}
SECRET = "responses-test-secret"


@dataclass
class Pool:
    env: dict[str, str]
    workers: dict[str, WorkerProcess]
    logs: Path
    gateway: GatewayProcess | None = None
    extra: list[GatewayProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    def client(self, key: str = "key-a") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def state(self) -> ResponseState:
        """The gateway's store of responses, read directly (to check the token ids it keeps)."""
        return ResponseState(redis.Redis.from_url(self.env["KVPOOL_REDIS_URL"]), 3600, 1 << 30)

    def tenant(self, key: str = "key-a"):  # noqa: ANN201
        return Tenants(KEYS, SECRET).resolve(f"Bearer {key}")

    def stop(self, name: str) -> None:
        """Warm shutdown: the worker withdraws its advert, so no request is routed to it."""
        self.workers[name].stop()

    def start(self, name: str) -> None:
        """Start a stopped worker again under its name, with an empty context."""
        self.workers[name] = WorkerProcess(name, self.env, self.logs / f"{name}.log").start()

    def gateway_named(self, model_name: str) -> GatewayProcess:
        """Another gateway in front of the same workers, serving the model under another name; stopped with the pool."""
        env = {**self.env, "KVPOOL_CHAT_TEMPLATE_FILE": str(TOOLS_TEMPLATE), "KVPOOL_MODEL_NAME": model_name}
        g = GatewayProcess(env, free_port(), self.logs / f"gateway-{model_name}.log").start()
        self.extra.append(g)
        return g


@contextmanager
def responses_pool(
    redis_server: RedisServer, s3_server: S3Server, model: Path, logs: Path, workers: int, n_ctx: int = 2048
) -> Iterator[Pool]:
    redis.Redis.from_url(redis_server.url).flushall()
    store = s3_settings(s3_server.endpoint_url, f"kvpool-test-{uuid.uuid4().hex[:12]}", redis_server.url)
    env = {
        **env_for_pool(redis_server.url, store, model, POOL_CHUNK),
        "KVPOOL_N_CTX": str(n_ctx),
        "KVPOOL_API_KEYS": json.dumps(KEYS),
        "KVPOOL_TENANT_SECRET": SECRET,
    }
    names = [f"r{i + 1}" for i in range(workers)]
    pool = Pool(env, {n: WorkerProcess(n, env, logs / f"{n}.log") for n in names}, logs)
    pool.gateway = GatewayProcess({**env, "KVPOOL_CHAT_TEMPLATE_FILE": str(TOOLS_TEMPLATE)}, free_port(), logs / "gateway.log")
    try:
        start_together([*pool.workers.values(), pool.gateway])
        yield pool
    finally:
        for g in [pool.gateway, *pool.extra]:
            if g is not None:
                g.stop()
        for w in pool.workers.values():
            w.kill()
