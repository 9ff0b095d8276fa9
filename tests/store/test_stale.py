"""Index entries whose blob is gone: dropped with all that hangs from them, and reconciled after an outage.

On a real redis-server and S3 over HTTP (SeaweedFS), and the filesystem where a test runs on
each backend: a fetch that finds a blob missing drops its entry, the chunks deeper on
its chains and the tails hanging from them, so the bytes counted are the bytes stored;
an unreachable S3 drops nothing; and once the store answers again after an outage, a
bounded reconciliation fixes entries that nobody looks up.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from gateway.pool.procs import RedisServer
from gateway.pool.s3server import S3Server
from store.backends.fs import FsBackend
from store.backends.s3 import S3Backend
from store.blob import BlobName
from store.chain import CacheFormat, Namespace
from store.errors import StoreUnavailable
from store.index import RedisIndex
from store.store import Store
from tests.helpers import poll, s3_settings, stored_depth

NS = Namespace("fp", CacheFormat.of("f16", "f16", False), chunk_size=8)


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n)


def publish(store: Store, tokens: np.ndarray) -> list[bytes]:
    """Every full chunk of ``tokens`` and its tail."""
    keys = NS.chain(tokens)
    store.publish(NS, tokens, keys, {i: keys[i] * 64 for i in range(len(keys))})
    if len(tokens) % NS.chunk_size:
        store.publish_tail(NS, tokens, keys, b"tail" * 64)
    return keys


def two_prompts_that_part(store: Store) -> tuple[np.ndarray, list[bytes], np.ndarray, list[bytes]]:
    """A: 8 chunks and a tail. B: A's first 3 chunks, then 5 of its own and a tail. 15 entries in all."""
    a = prompt(1, 8 * 8 + 3)
    b = np.concatenate([a[:24], prompt(2, 5 * 8 + 5)])
    ka, kb = publish(store, a), publish(store, b)
    assert store.index.count() == 15
    return a, ka, b, kb


def bucket_bytes(store: Store) -> int:
    return sum(o.size for o in store.backend.list(""))


def gauge(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


@pytest.fixture
def own_s3() -> Iterator[S3Server]:
    """An S3 server this test may stop (and start again, empty once wiped)."""
    server = S3Server().start()
    yield server
    server.stop()


def open_s3_store(server: S3Server, redis_url: str, **kw: int) -> Store:
    settings = s3_settings(server.endpoint_url, "kvpool-stale", redis_url)
    return Store(
        S3Backend.from_settings(settings, bucket="kvpool-stale", prefix="p"),
        RedisIndex.from_url(redis_url, connect_timeout_s=1, read_timeout_s=2),
        **kw,
    )


def test_an_s3_that_came_back_empty_loses_every_entry_at_the_first_fetch(store_settings_s3, redis_url: str) -> None:
    """The fetch of A drops A, B's chunks past the shared ones and both tails: the bytes counted fall to what is stored, 0."""
    with Store.open(store_settings_s3) as store:
        a, ka, b, kb = two_prompts_that_part(store)
        for obj in list(store.backend.list("")):  # S3 came back empty
            store.backend.delete(obj.name)
        stale_before = gauge("kvpool_store_stale_index_entries_total")
        hit = store.find(NS, a, ka)
        assert hit.tokens == len(a), "the index still says A is stored"
        got = store.fetch_prefix(NS, a, ka, 0, hit)
        assert got.chunks == [] and got.tail is None
        assert store.index.count() == 0, [e.key.hex() for e in store.index.entries()]
        assert store.index.total_bytes() == bucket_bytes(store) == 0
        assert gauge("kvpool_store_bytes_stored") == 0
        assert gauge("kvpool_store_stale_index_entries_total") == stale_before + 15
        assert store.find(NS, b, kb).tokens == 0, "B was never looked up, and is gone too"


def test_a_lost_blob_takes_what_hangs_from_it_with_it_and_nothing_else(store: Store) -> None:
    """One blob lost: its descendants (on both chains) are dropped and their blobs deleted; the chunks before it stay."""
    a, ka, b, kb = two_prompts_that_part(store)
    other = publish(store, prompt(3, 4 * 8))
    store.backend.delete(str(BlobName(NS.key, 2, ka[2])))
    assert len(store.fetch(NS, a, ka, 0, 8)) == 2
    assert stored_depth(store, NS, ka) == stored_depth(store, NS, kb) == 2
    assert stored_depth(store, NS, other) == 4
    assert store.index.count() == 2 + 4, "A's (and B's) first two chunks, and the other prompt's four"
    poll(lambda: bucket_bytes(store) == store.index.total_bytes(), "the blobs of the dropped entries are deleted")
    assert gauge("kvpool_store_bytes_stored") == store.index.total_bytes()
    assert store.find(NS, b, kb).tokens == 2 * 8


def test_a_lost_chunk_found_as_a_candidate_takes_its_tail_with_it(store: Store) -> None:
    """Q parts from P inside P's last full chunk, so the lookup offers that chunk as Q's best candidate (like a tail)."""
    p = prompt(4, 4 * 8 + 5)
    keys = publish(store, p)
    q = np.concatenate([p[:30], prompt(5, 10)])
    hit = store.find(NS, q, NS.chain(q))
    assert hit.depth == 3 and hit.tail is not None and hit.tail.key == keys[3] and hit.tail.usable == 6
    store.backend.delete(str(BlobName(NS.key, 3, keys[3])))
    got = store.fetch_prefix(NS, q, NS.chain(q), 0, hit)
    assert len(got.chunks) == 3 and got.tail is None
    assert store.index.count() == 3, "P's chunk 3 is gone, and P's tail hung from it"
    assert store.find(NS, p, keys).tokens == 3 * 8
    poll(lambda: bucket_bytes(store) == store.index.total_bytes(), "the tail's blob is deleted")


def test_an_unreachable_s3_drops_nothing(own_s3: S3Server, redis_url: str) -> None:
    """Neither a fetch nor a reconciliation pass takes an outage for lost data."""
    with open_s3_store(own_s3, redis_url, reconcile_batch=4) as store:
        a, ka, b, kb = two_prompts_that_part(store)
        count, total = store.index.count(), store.index.total_bytes()
        own_s3.stop()
        hit = store.find(NS, a, ka)
        got = store.fetch_prefix(NS, a, ka, 0, hit)
        assert got.chunks == [] and got.tail is None
        with pytest.raises(StoreUnavailable):
            publish(store, prompt(5, 16))
        reconciled = store.reconciler.round()
        assert reconciled.aborted and not reconciled.complete and sum(p.dropped for p in reconciled.passes) == 0
        assert (store.index.count(), store.index.total_bytes()) == (count, total)
        assert store.find(NS, a, ka).tokens == len(a) and store.find(NS, b, kb).tokens == len(b)


def test_after_an_outage_a_bounded_reconciliation_drops_what_is_gone_without_a_lookup(own_s3: S3Server, redis_url: str) -> None:
    with open_s3_store(own_s3, redis_url, reconcile_batch=4) as store:
        chains = [publish(store, prompt(10 + i, 4 * 8)) for i in range(3)]
        own_s3.stop()
        with pytest.raises(StoreUnavailable):
            publish(store, prompt(20, 16))  # the store sees the outage
        own_s3.wipe()
        own_s3.start()  # back, and empty
        assert store.reconciler.last is None
        fresh = publish(store, prompt(21, 3 * 8))  # the first operation that succeeds again starts the reconciliation
        poll(lambda: store.reconciler.last is not None, "a reconciliation round ran")
        done = store.reconciler.last
        assert done.complete and not done.aborted
        assert len(done.passes) > 1 and all(p.checked <= 4 for p in done.passes), done.passes
        assert [stored_depth(store, NS, k) for k in chains] == [0, 0, 0]
        assert stored_depth(store, NS, fresh) == 3
        assert store.index.count() == 3, "the fresh prompt's chunks"
        assert store.index.total_bytes() == bucket_bytes(store) == gauge("kvpool_store_bytes_stored")


def test_redis_answering_again_after_an_outage_starts_the_reconciliation_too(tmp_path: Path) -> None:
    """Redis back from its append-only file, with entries for blobs deleted meanwhile (another process's GC, say)."""
    server = RedisServer(tmp_path / "redis", persist=True).start()
    try:
        with Store(FsBackend(tmp_path / "blobs"), RedisIndex.from_url(server.url, connect_timeout_s=1, read_timeout_s=2)) as store:
            a, ka, b, kb = two_prompts_that_part(store)
            server.stop()
            with pytest.raises(StoreUnavailable):
                store.find(NS, a, ka)
            for obj in list(store.backend.list("")):
                store.backend.delete(obj.name)
            server = RedisServer(tmp_path / "redis", port=server.port, persist=True).start()
            assert store.find(NS, b, kb).tokens == len(b), "the index came back as it was"
            poll(lambda: store.reconciler.last is not None, "a reconciliation round ran")
            assert store.index.count() == 0 and store.index.total_bytes() == 0
    finally:
        server.stop()


def test_a_reconciliation_that_finds_nothing_gone_stops_after_one_pass(store: Store) -> None:
    """An outage that lost nothing costs one batch of checks."""
    for i in range(3):
        publish(store, prompt(30 + i, 4 * 8))
    store.reconciler.batch = 4
    done = store.reconciler.round()
    assert [(p.checked, p.gone) for p in done.passes] == [(4, 0)]
    assert store.index.count() == 12
