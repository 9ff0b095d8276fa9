"""Faults of a real S3 server (SeaweedFS) that the store meets: a restart, a stall, a full disk, names it refuses."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from gateway.pool.s3server import S3Server
from store.backends.s3 import S3Backend
from store.chain import CacheFormat, Namespace
from store.errors import StoreUnavailable
from store.index import RedisIndex
from store.store import Store
from tests.helpers import s3_settings, stored_depth

NS = Namespace("real", CacheFormat(), chunk_size=4)


def chain(seed: int, n: int = 32) -> tuple[np.ndarray, list[bytes]]:
    tokens = np.random.default_rng(seed).integers(0, 30000, n)
    return tokens, NS.chain(tokens)


def open_store(server: S3Server, redis_url: str, bucket: str) -> Store:
    settings = s3_settings(server.endpoint_url, bucket, redis_url)
    return Store(
        S3Backend.from_settings(settings, bucket=bucket, prefix="p"),
        RedisIndex.from_url(redis_url, connect_timeout_s=1, read_timeout_s=2),
    )


@pytest.fixture
def own_s3() -> Iterator[S3Server]:
    server = S3Server().start()
    yield server
    server.resume()
    server.stop()


def test_a_restarted_server_keeps_every_blob(own_s3: S3Server, redis_url: str) -> None:
    store = open_store(own_s3, redis_url, "kvpool-restart")
    tokens, keys = chain(1)
    payloads = {i: f"chunk {i}".encode() * 100 for i in range(len(keys))}
    store.publish(NS, tokens, keys, payloads)
    own_s3.kill()
    assert store.fetch(NS, tokens, keys, 0, len(keys)) == [], "down: a miss"
    own_s3.start()
    deadline = time.monotonic() + 30
    while len(back := store.fetch(NS, tokens, keys, 0, len(keys))) < len(keys):  # its volumes load after its S3 port answers
        assert time.monotonic() < deadline, f"{len(back)} of {len(keys)} blobs came back after the restart"
        time.sleep(0.2)
    assert [bytes(p) for p in back] == list(payloads.values())
    assert stored_depth(store, NS, keys) == len(keys), "nothing was dropped from the index"


@pytest.mark.serial  # a wall-clock bound
def test_a_stalled_server_is_a_quick_miss_and_answers_again_when_it_resumes(own_s3: S3Server, redis_url: str) -> None:
    """A server that accepts connections but does not answer costs one read timeout per try, then a miss."""
    store = open_store(own_s3, redis_url, "kvpool-stall")
    tokens, keys = chain(2)
    store.publish(NS, tokens, keys, {i: b"payload" for i in range(len(keys))})
    own_s3.pause()
    t0 = time.monotonic()
    assert store.fetch(NS, tokens, keys, 0, len(keys)) == []
    took = time.monotonic() - t0
    assert took < 2 * (2.0 + 1.0) + 2, f"{took:.1f} s: read timeout 2 s, one retry"
    with pytest.raises(StoreUnavailable, match=str(own_s3.port)):
        store.backend.put("chunks/late", b"x")
    own_s3.resume()
    assert [bytes(p) for p in store.fetch(NS, tokens, keys, 0, len(keys))] == [b"payload"] * len(keys)
    assert stored_depth(store, NS, keys) == len(keys)


def test_a_full_disk_refuses_writes_and_keeps_serving_what_it_holds(redis_url: str) -> None:
    """One volume of 1 MB: once it is full, a publish fails as unavailable and indexes nothing; reads go on."""
    server = S3Server(volume_mb=1, volumes=1).start()
    try:
        store = open_store(server, redis_url, "kvpool-full")
        first, first_keys = chain(3, 8)
        held = {i: bytes([i]) * 100_000 for i in range(len(first_keys))}
        store.publish(NS, first, first_keys, held)
        more, more_keys = chain(4, 64)
        with pytest.raises(StoreUnavailable, match="InternalError"):
            for i in range(len(more_keys)):
                store.publish(NS, more, more_keys, {i: b"y" * 300_000})
        assert stored_depth(store, NS, more_keys) < len(more_keys), "what was not written is not indexed"
        assert [bytes(p) for p in store.fetch(NS, first, first_keys, 0, len(first_keys))] == list(held.values())
    finally:
        server.stop()


def test_a_two_character_bucket_is_refused_by_name(s3_server: S3Server, redis_url: str) -> None:
    """S3 bucket names have 3 to 63 characters; a real server says so when the store creates the bucket."""
    settings = s3_settings(s3_server.endpoint_url, "kv", redis_url)
    with pytest.raises(StoreUnavailable, match="InvalidBucketName"):
        S3Backend.from_settings(settings, bucket="kv")
