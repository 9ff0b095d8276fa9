"""Fixtures for the gateway: a real ``kvpool gateway`` process in front of real workers, and the official openai client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.pool.procs import GatewayProcess, free_port
from tests.helpers import TOOLS_TEMPLATE


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


@pytest.fixture
def smol_pool(start_worker, start_gateway, smollm2: Path) -> GatewayProcess:
    """One worker and a gateway serving the real model, SmolLM2-135M-Instruct (answers that depend on text)."""
    start_worker("smol-1", KVPOOL_MODEL=str(smollm2))
    return start_gateway(KVPOOL_MODEL=str(smollm2))


@pytest.fixture
def smol_tools_pool(start_worker, start_gateway, smollm2: Path) -> GatewayProcess:
    """SmolLM2 served with a ChatML template that has tools (Hermes <tool_call> blocks, as Qwen2.5's)."""
    start_worker("smol-1", KVPOOL_MODEL=str(smollm2))
    return start_gateway(KVPOOL_MODEL=str(smollm2), KVPOOL_CHAT_TEMPLATE_FILE=str(TOOLS_TEMPLATE))
