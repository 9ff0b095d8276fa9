"""A pool per test module for the Messages API: a real redis-server, S3 over HTTP, SmolLM2, ``kvpool worker`` and ``kvpool gateway``.

Module-scoped, so a module's tests share one pool (the model loads once per worker); each
module gets its own Redis database contents and bucket.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import Pool, running_pool


@pytest.fixture(scope="module")
def smol_messages(redis_server, s3_server, smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """One worker and a gateway serving SmolLM2 with its own chat template (ChatML, no tools), a 4,096-token context."""
    with running_pool(redis_server, s3_server, smollm2, tmp_path_factory.mktemp("messages"), ["smol-1"], KVPOOL_N_CTX="4096") as pool:
        yield pool
