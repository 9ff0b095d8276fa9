"""``kvpool store`` as a user runs it: a real process, settings from KVPOOL_* variables."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gateway.pool.procs import free_port
from store.backends.fs import FsBackend
from store.blob import BlobName
from store.chain import CacheFormat, Namespace
from store.cli import parse_size
from store.index import RedisIndex
from store.store import Store
from tests.helpers import stored_depth

NS = Namespace("fp", CacheFormat(), chunk_size=4)


def kvpool(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    bindir = Path(sys.executable).parent
    return subprocess.run([str(bindir / "kvpool"), *args], capture_output=True, text=True, timeout=60, env={**os.environ, **env})


@pytest.fixture
def filled(tmp_path: Path, redis_url: str) -> tuple[dict[str, str], Store, list[bytes]]:
    store = Store(FsBackend(tmp_path / "blobs"), RedisIndex.from_url(redis_url))
    tokens = np.arange(40)
    keys = NS.chain(tokens)
    store.publish(NS, tokens, keys, {i: bytes(100) for i in range(len(keys))})
    env = {"KVPOOL_REDIS_URL": redis_url, "KVPOOL_STORE_URL": str(tmp_path / "blobs")}
    return env, store, keys


def test_stats_and_ls(filled) -> None:
    env, store, keys = filled
    stats = json.loads(kvpool(env, "store", "stats", "--json").stdout)
    assert stats["chunks"] == 10 and stats["bytes"] == store.index.total_bytes()
    rows = json.loads(kvpool(env, "store", "ls", "--json", "--limit", "3").stdout)
    assert len(rows) == 3 and rows[0]["key"] == keys[0].hex()
    table = kvpool(env, "store", "stats")
    assert table.returncode == 0 and "chunks" in table.stdout


def test_stats_split_the_bytes_by_the_kernels_that_computed_them_and_reindex_keeps_the_split(tmp_path: Path, redis_url: str) -> None:
    """Two kinds of worker publish (each Store says what kernels it runs), a third publisher says only its layout,
    and chunks of a namespace nobody described are unknown."""
    index = RedisIndex.from_url(redis_url)
    tokens = np.arange(40)
    for kernels, chunks in (("cpu=AVX2", 6), ("cpu=AVX512", 3)):
        ns = Namespace("fp", CacheFormat.of("f16", "f16", False, {"kernels": kernels}), chunk_size=4)
        store = Store(FsBackend(tmp_path / "blobs"), index)
        store.about = {"kernels": kernels}
        store.publish(ns, tokens, ns.chain(tokens), {i: bytes(100) for i in range(chunks)})
    bare = Namespace("fp", CacheFormat.of("f16", "f16", False, {"kernels": "0123abcd"}), chunk_size=4)
    Store(FsBackend(tmp_path / "blobs"), index).publish(bare, tokens, bare.chain(tokens), {0: bytes(100)})  # says only its layout
    index.add(b"k" * 16, b"n" * 16, 0, 50)  # indexed by an older kvpool, which described nothing
    env = {"KVPOOL_REDIS_URL": redis_url, "KVPOOL_STORE_URL": str(tmp_path / "blobs")}

    stats = json.loads(kvpool(env, "store", "stats", "--json").stdout)
    split = stats["bytes_by_kernels"]
    assert list(split) == ["cpu=AVX2", "cpu=AVX512", "kernels=0123abcd", "unknown"] and split["unknown"] == 50
    assert split["cpu=AVX2"] == 2 * (split["cpu=AVX512"]) and sum(split.values()) == stats["bytes"]
    table = kvpool(env, "store", "stats").stdout
    assert "bytes, kernels cpu=AVX2" in table and "bytes, kernels unknown" in table
    assert kvpool(env, "store", "reindex").returncode == 0
    assert json.loads(kvpool(env, "store", "stats", "--json").stdout)["bytes_by_kernels"] == {
        k: v
        for k, v in split.items()
        if k != "unknown"  # the entry without a blob is gone; the described namespaces stay described
    }


def test_verify_reports_and_repairs(filled) -> None:
    env, store, keys = filled
    assert kvpool(env, "store", "verify").returncode == 0
    name = str(BlobName(NS.key, 4, keys[4]))
    store.backend.put(name, store.backend.get(name)[:-3])
    bad = kvpool(env, "store", "verify")
    assert bad.returncode == 1 and name in bad.stdout and "1 bad" in bad.stdout
    assert kvpool(env, "store", "verify", "--repair").returncode == 0
    assert kvpool(env, "store", "verify").returncode == 0
    assert stored_depth(store, NS, keys) == 4


def test_gc_and_reindex(filled) -> None:
    env, store, keys = filled
    per_chunk = store.index.total_bytes() // 10
    out = kvpool(env, "store", "gc", "--max-bytes", str(per_chunk * 6))
    assert out.returncode == 0 and "evicted 4 chunks" in out.stdout
    store.index.r.flushdb()
    out = kvpool(env, "store", "reindex")
    assert out.returncode == 0 and "indexed 6 chunks" in out.stdout
    assert stored_depth(store, NS, keys) == 6


def test_unreachable_redis_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    port = free_port()
    out = kvpool({"KVPOOL_REDIS_URL": f"redis://127.0.0.1:{port}/0", "KVPOOL_STORE_URL": str(tmp_path)}, "store", "stats")
    assert out.returncode == 1
    assert f"127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr


def test_bad_size_is_a_usage_error(filled) -> None:
    env, _, _ = filled
    out = kvpool(env, "store", "gc", "--max-bytes", "lots")
    assert out.returncode == 2 and "not a size" in out.stderr


def test_parse_size() -> None:
    assert parse_size("1000") == 1000
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5 MB") == 1_500_000
    with pytest.raises(ValueError):
        parse_size("5 parsecs")


def test_bad_settings_are_a_usage_error_naming_the_variable(tmp_path: Path) -> None:
    out = kvpool({"KVPOOL_IO_THREADS": "abc", "KVPOOL_STORE_URL": str(tmp_path)}, "store", "stats")
    assert out.returncode == 2 and "Usage: kvpool" in out.stderr and "Traceback" not in out.stderr
    assert "KVPOOL_IO_THREADS: Input should be a valid integer" in out.stderr
