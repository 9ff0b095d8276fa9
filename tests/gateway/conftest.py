"""Fixtures for the gateway: a real ``kvpool gateway`` process in front of real workers, and the official openai client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from gateway.cli.procs import GatewayProcess, free_port

MODEL = "kvpool-tiny-s0"


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


def openai_client(gateway: GatewayProcess, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=api_key, max_retries=0, timeout=120)


SMOL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture
def smol_pool(start_worker, start_gateway, smollm2: Path) -> GatewayProcess:
    """One worker and a gateway serving the real model, SmolLM2-135M-Instruct (answers that depend on text)."""
    start_worker("smol-1", KVPOOL_MODEL=str(smollm2))
    return start_gateway(KVPOOL_MODEL=str(smollm2))


TOOLS_TEMPLATE = Path(__file__).resolve().parents[2] / "gateway" / "templates" / "chatml-tools.jinja"


@pytest.fixture
def smol_tools_pool(start_worker, start_gateway, smollm2: Path) -> GatewayProcess:
    """SmolLM2 served with a ChatML template that has tools (Hermes <tool_call> blocks, as Qwen2.5's)."""
    start_worker("smol-1", KVPOOL_MODEL=str(smollm2))
    return start_gateway(KVPOOL_MODEL=str(smollm2), KVPOOL_CHAT_TEMPLATE_FILE=str(TOOLS_TEMPLATE))
