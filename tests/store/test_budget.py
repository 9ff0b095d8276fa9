"""The store is bounded by default: a folder store by a share of its disk, stated at start-up; S3 by what is set."""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from store.budget import DISK_CAP, DISK_SHARE
from store.chain import CacheFormat, Namespace
from store.settings import StoreSettings
from store.store import Store
from tests.helpers import stored_depth

NS = Namespace("budget", CacheFormat(), chunk_size=4)
CHUNK = 64 * 1024


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB disk of its own (tmpfs), so that the default budget is small enough to fill."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small disk needs root (CI runs as root)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def publish_chain(store: Store, seed: int, chunks: int = 8) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 30000, chunks * NS.chunk_size)
    keys = NS.chain(tokens)
    store.publish(NS, tokens, keys, {i: bytes([seed % 256]) * CHUNK for i in range(chunks)})
    return keys


def test_a_folder_store_is_bounded_by_its_disk_by_default_and_evicts_the_oldest_chains(
    small_disk: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = StoreSettings(store_url=str(small_disk / "store"), redis_url=redis_url)
    assert settings.store_max_bytes is None
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    with caplog.at_level(logging.INFO, logger="kvpool.store"), Store.open(settings) as store:
        said = [r for r in caplog.records if r.getMessage() == "store.budget"]
        assert store.max_bytes is not None and abs(store.max_bytes - DISK_SHARE * free) <= 64 * 1024
        assert len(said) == 1 and said[0].max_bytes == store.max_bytes and "20% of 16.0 MiB" in said[0].source  # type: ignore[attr-defined]
        chains = [publish_chain(store, seed) for seed in range(16)]  # 16 x 512 KiB: over twice the budget
        assert 16 * 8 * CHUNK > 2 * store.max_bytes
        assert store.index.total_bytes() <= store.max_bytes
        on_disk = sum(f.stat().st_size for f in (small_disk / "store").rglob("*") if f.is_file())
        assert on_disk <= store.max_bytes
        depths = [stored_depth(store, NS, keys) for keys in chains]
        assert depths[0] == depths[1] == 0, "the oldest chains are evicted"
        assert depths[-1] == depths[-2] == 8, "the newest are whole"


def test_a_set_budget_wins_and_s3_has_none_by_default(store_settings_s3: StoreSettings, tmp_path: Path, redis_url: str) -> None:
    with Store.open(store_settings_s3) as store:
        assert store.max_bytes is None
    with Store.open(store_settings_s3.model_copy(update={"store_max_bytes": 1000})) as store:
        assert store.max_bytes == 1000
    folder = StoreSettings(store_url=str(tmp_path / "store"), redis_url=redis_url)
    with Store.open(folder) as store:
        assert store.max_bytes is not None and 0 < store.max_bytes <= DISK_CAP
