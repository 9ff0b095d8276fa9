"""Fixtures for driving real worker processes: build jobs as the gateway would, read their results, compare with a cold run."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from tests.helpers import PoolClient


@pytest.fixture
def client(redis_url: str, tiny_model: Path) -> PoolClient:
    return PoolClient(redis.Redis.from_url(redis_url), tiny_model)


@pytest.fixture(scope="session")
def uncuttable_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Generated models whose state kvpool cannot cut: ``tiny-swa`` (cohere2, sliding window), ``tiny-ssm`` (mamba, recurrent),
    ``tiny-hybrid`` (jamba, Mamba and attention layers)."""
    from worker.models.synth import ensure_model

    folder = tmp_path_factory.mktemp("models")
    return {size: ensure_model(size, folder) for size in ("tiny-swa", "tiny-ssm", "tiny-hybrid")}
