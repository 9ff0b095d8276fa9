"""Fixtures for the gateway: a real ``kvpool gateway`` process in front of real workers, and the official openai client.

Tests that only send requests and read the answers share one SmolLM2 worker for the whole session
(`smol_shared`), each as a tenant of its own, so the model loads and self-checks once, not once per
test. Tests that stop workers or change settings start their own pools (`start_worker`, `start_gateway`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.pool.procs import GatewayProcess, free_port
from gateway.pool.s3server import S3Server
from tests.helpers import TOOLS_TEMPLATE, SharedPool, Tenancy, shared_pool


@pytest.fixture
def start_gateway(pool_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., GatewayProcess]]:
    started: list[GatewayProcess] = []

    def start(**env: str) -> GatewayProcess:
        g = GatewayProcess({**pool_env, **env}, free_port(), tmp_path / f"gateway{len(started)}.log").start()
        started.append(g)
        return g

    yield start
    for g in started:
        g.stop()


@pytest.fixture(scope="session")
def smol_shared(s3_server: S3Server, smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedPool]:
    """The session's shared SmolLM2 pool, on a Redis of its own (tests that empty the session's Redis never reach it)."""
    logs = tmp_path_factory.mktemp("smol-shared")
    with shared_pool(s3_server, smollm2, logs, ["smol-1"]) as shared:
        yield shared


@pytest.fixture
def smol_pool(smol_shared: SharedPool) -> Tenancy:
    """SmolLM2-135M-Instruct with its own chat template (answers that depend on text), as a tenant of the shared pool."""
    return smol_shared.tenancy()


@pytest.fixture
def smol_tools_pool(smol_shared: SharedPool) -> Tenancy:
    """SmolLM2 served with a ChatML template that has tools (Hermes <tool_call> blocks, as Qwen2.5's), as a tenant of the shared pool."""
    return smol_shared.tenancy(TOOLS_TEMPLATE)
