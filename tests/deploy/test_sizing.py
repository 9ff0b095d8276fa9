"""The sizing figures deploy/README.md gives are measured, not guessed: Redis memory per chunk in the index."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import redis

from gateway.pool.procs import RedisServer
from store.index import RedisIndex
from tests.deploy import deployfiles as df

ENTRIES = 10_000


def readme_bytes_per_entry() -> int:
    m = re.search(r"about ([\d,]+) bytes per chunk in the index", (df.DEPLOY / "README.md").read_text())
    assert m, "deploy/README.md gives no Redis memory per index entry"
    return int(m.group(1).replace(",", ""))


def test_redis_memory_per_index_entry_is_what_the_readme_says(tmp_path: Path) -> None:
    """Entries as the store writes them (16-byte chain keys and namespace, a blob size), into a real redis-server."""
    with RedisServer(tmp_path / "redis", persist=False) as server:
        conn = redis.Redis.from_url(server.url)
        index = RedisIndex(conn)
        namespace = os.urandom(16)
        index.add(os.urandom(16), namespace, 0, 33_554_432)  # the script is loaded, the keys exist
        before = conn.info("memory")["used_memory"]
        now = time.time()
        for i in range(ENTRIES):
            index.add(os.urandom(16), namespace, i % 64, 33_554_432 + i, now=now)
        assert index.count() == ENTRIES + 1
        per_entry = (conn.info("memory")["used_memory"] - before) / ENTRIES
    assert 0.75 * readme_bytes_per_entry() <= per_entry <= 1.25 * readme_bytes_per_entry(), f"measured {per_entry:.0f} bytes per entry"
