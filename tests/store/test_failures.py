"""An unreachable S3 or Redis is a named, quick `StoreUnavailable`, never a hang."""

import time
from pathlib import Path

import numpy as np
import pytest

from gateway.pool.procs import RedisServer, free_port
from gateway.pool.s3server import S3Server
from store.backends.s3 import S3Backend
from store.chain import CacheFormat, Namespace
from store.errors import StoreUnavailable
from store.index import RedisIndex
from store.store import Store
from tests.helpers import s3_settings, stored_depth

NS = Namespace("fp", CacheFormat(), chunk_size=4)
TOKENS = np.arange(32)
KEYS = NS.chain(TOKENS)


@pytest.fixture
def own_s3() -> S3Server:
    """An S3 endpoint this test may stop."""
    server = S3Server().start()
    yield server
    server.stop()


def open_s3_store(server: S3Server, redis_url: str) -> Store:
    settings = s3_settings(server.endpoint_url, "kvpool-failures", redis_url)
    return Store(
        S3Backend.from_settings(settings, bucket="kvpool-failures", prefix="p"),
        RedisIndex.from_url(redis_url, connect_timeout_s=1, read_timeout_s=2),
    )


def test_s3_stopped_mid_test_gives_store_unavailable_quickly(own_s3: S3Server, redis_url: str) -> None:
    store = open_s3_store(own_s3, redis_url)
    store.publish(NS, TOKENS, KEYS, {i: b"payload" for i in range(len(KEYS))})
    assert len(store.fetch(NS, TOKENS, KEYS, 0, len(KEYS))) == len(KEYS)
    own_s3.stop()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as err:
        store.backend.get("chunks/anything")
    assert time.monotonic() - t0 < 5
    assert str(own_s3.port) in str(err.value)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable):
        store.publish(NS, np.arange(32, 64), NS.chain(np.arange(32, 64)), {0: b"x"})
    assert time.monotonic() - t0 < 5


def test_fetch_with_s3_down_is_a_miss_not_an_error(own_s3: S3Server, redis_url: str) -> None:
    store = open_s3_store(own_s3, redis_url)
    store.publish(NS, TOKENS, KEYS, {i: b"payload" for i in range(len(KEYS))})
    own_s3.stop()
    t0 = time.monotonic()
    assert store.fetch(NS, TOKENS, KEYS, 0, len(KEYS)) == []
    assert time.monotonic() - t0 < 5
    assert stored_depth(store, NS, KEYS) == len(KEYS), "an unreachable backend is not a reason to forget the index"


def test_unreachable_s3_at_open_names_the_endpoint() -> None:
    port = free_port()
    settings = s3_settings(f"http://127.0.0.1:{port}", "b", "redis://127.0.0.1:1/0")
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}"):
        S3Backend.from_settings(settings, bucket="b")
    assert time.monotonic() - t0 < 5


def test_redis_stopped_gives_store_unavailable_quickly(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    index = RedisIndex.from_url(server.url, connect_timeout_s=1, read_timeout_s=2)
    index.add(KEYS[0], NS.key, 0, 10)
    server.stop()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{server.port}"):
        index.deepest(KEYS)
    assert time.monotonic() - t0 < 5


def test_store_lookup_with_redis_down_raises_store_unavailable(tmp_path: Path) -> None:
    from store.backends.fs import FsBackend

    port = free_port()
    store = Store(FsBackend(tmp_path), RedisIndex.from_url(f"redis://127.0.0.1:{port}/0", connect_timeout_s=1))
    with pytest.raises(StoreUnavailable):
        stored_depth(store, NS, KEYS)
    with pytest.raises(StoreUnavailable):
        store.publish(NS, TOKENS, KEYS, {0: b"x"})


def test_an_s3_that_comes_back_empty_is_data_lost_not_an_outage(own_s3: S3Server, redis_url: str) -> None:
    """The bucket is gone: stale index entries are dropped on first touch, and the next publish recreates the bucket."""
    store = open_s3_store(own_s3, redis_url)
    store.publish(NS, TOKENS, KEYS, {i: b"payload" for i in range(len(KEYS))})
    own_s3.stop()
    own_s3.wipe()
    own_s3.start()  # the same endpoint again, its disk lost: no buckets
    assert not store.backend.exists("anything"), "the endpoint answers"
    assert stored_depth(store, NS, KEYS) == len(KEYS)
    assert store.fetch(NS, TOKENS, KEYS, 0, len(KEYS)) == []
    assert stored_depth(store, NS, KEYS) == 0, "every entry of the chain from the missing chunk on is dropped"
    assert store.publish(NS, TOKENS, KEYS, {i: b"payload" for i in range(len(KEYS))}) == len(KEYS)
    assert [bytes(p) for p in store.fetch(NS, TOKENS, KEYS, 0, len(KEYS))] == [b"payload"] * len(KEYS)
