"""A pool per test module for the Messages API: a real redis-server, S3 over HTTP, SmolLM2, ``kvpool worker`` and ``kvpool gateway``.

Module-scoped, so a module's tests share one pool (the model loads once per worker); each
module gets its own Redis database contents and bucket.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anthropic
import pytest
import redis

from gateway.cli.procs import GatewayProcess, RedisServer, S3Server, WorkerProcess, free_port
from store.settings import StoreSettings
from tests.conftest import POOL_CHUNK, env_for_pool, s3_settings

SMOL = "SmolLM2-135M-Instruct.Q4_1"


@dataclass
class Pool:
    gateway: GatewayProcess
    workers: dict[str, WorkerProcess]
    env: dict[str, str]
    redis_url: str
    store: StoreSettings
    logs: Path

    def client(self, **kwargs: object) -> anthropic.Anthropic:
        kwargs.setdefault("api_key", "unused")
        return anthropic.Anthropic(base_url=self.gateway.url, max_retries=0, timeout=600, **kwargs)  # type: ignore[arg-type]

    def start_worker(self, name: str) -> WorkerProcess:
        w = WorkerProcess(name, self.env, self.logs / f"{name}.log").start()
        self.workers[name] = w
        return w


@contextmanager
def running_pool(redis_server: RedisServer, s3_server: S3Server, model: Path, logs: Path, workers: list[str], **env: str) -> Iterator[Pool]:
    redis.Redis.from_url(redis_server.url).flushall()
    settings = s3_settings(s3_server.endpoint_url, f"kvpool-test-{uuid.uuid4().hex[:12]}", redis_server.url)
    pool_env = {**env_for_pool(redis_server.url, settings, model, POOL_CHUNK), **env}
    pool = Pool(GatewayProcess(pool_env, free_port(), logs / "gateway.log"), {}, pool_env, redis_server.url, settings, logs)
    try:
        for name in workers:
            pool.start_worker(name)
        pool.gateway.start()
        yield pool
    finally:
        pool.gateway.stop()
        for w in pool.workers.values():
            w.kill()


@pytest.fixture(scope="module")
def smol_messages(redis_server, s3_server, smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """One worker and a gateway serving SmolLM2 with its own chat template (ChatML, no tools), a 4,096-token context."""
    with running_pool(redis_server, s3_server, smollm2, tmp_path_factory.mktemp("messages"), ["smol-1"], KVPOOL_N_CTX="4096") as pool:
        yield pool
