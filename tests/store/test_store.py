"""The store end to end, on each backend: publish, lookup, verified fetch, eviction, reindex, verify."""

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from store.blob import BlobName
from store.chain import CacheFormat, Namespace
from store.index import lru_score
from store.maintenance import QUARANTINE_PREFIX
from store.store import Store
from tests.helpers import stored_depth

NS = Namespace("fp", CacheFormat.of("f16", "f16", False), chunk_size=8)


def tokens_for(seed: int, n: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n)


def payload(i: int, keys: list[bytes]) -> bytes:
    return keys[i] * 64


def publish_all(store: Store, tokens: np.ndarray, ns: Namespace = NS) -> list[bytes]:
    keys = ns.chain(tokens)
    store.publish(ns, tokens, keys, {i: payload(i, keys) for i in range(len(keys))})
    return keys


def test_publish_then_lookup_and_fetch(store: Store) -> None:
    tokens = tokens_for(0)
    keys = publish_all(store, tokens)
    assert stored_depth(store, NS, keys) == 8
    got = store.fetch(NS, tokens, keys, 0, 8)
    assert [bytes(p) for p in got] == [payload(i, keys) for i in range(8)]
    assert [bytes(p) for p in store.fetch(NS, tokens, keys, 3, 5)] == [payload(3, keys), payload(4, keys)]


def test_a_shared_prefix_is_found_by_another_prompt(store: Store) -> None:
    a = tokens_for(1)
    publish_all(store, a)
    b = np.concatenate([a[:40], tokens_for(2, 24)])
    assert stored_depth(store, NS, NS.chain(b)) == 5


def test_another_tenant_finds_nothing(store: Store) -> None:
    tokens = tokens_for(3)
    publish_all(store, tokens)
    other = Namespace(NS.model_fingerprint, NS.layout, NS.chunk_size, tenant_salt="tenant-b")
    assert stored_depth(store, other, other.chain(tokens)) == 0


def test_publish_is_idempotent(store: Store) -> None:
    tokens = tokens_for(4)
    keys = NS.chain(tokens)
    assert store.publish(NS, tokens, keys, {0: payload(0, keys), 1: payload(1, keys)}) == 2
    before = store.index.total_bytes()
    assert store.publish(NS, tokens, keys, {0: payload(0, keys), 1: payload(1, keys)}) == 0
    assert store.index.total_bytes() == before


def test_concurrent_publishers_of_one_chain(store: Store) -> None:
    tokens = tokens_for(5)
    keys = NS.chain(tokens)
    with ThreadPoolExecutor(4) as pool:
        added = list(pool.map(lambda _: store.publish(NS, tokens, keys, {i: payload(i, keys) for i in range(8)}), range(4)))
    assert sum(added) == 8
    assert store.index.count() == 8
    assert store.index.total_bytes() == sum(o.size for o in store.backend.list("chunks/"))
    assert len(store.fetch(NS, tokens, keys, 0, 8)) == 8


def test_publish_rejects_out_of_range_chunk(store: Store) -> None:
    tokens = tokens_for(6, 16)
    keys = NS.chain(tokens)
    with pytest.raises(ValueError):
        store.publish(NS, tokens, keys, {2: b"x"})


def test_lookup_stops_at_a_hole(store: Store) -> None:
    tokens = tokens_for(7)
    keys = NS.chain(tokens)
    store.publish(NS, tokens, keys, {i: payload(i, keys) for i in (0, 1, 2, 4, 5)})
    assert stored_depth(store, NS, keys) == 3


def corrupt(store: Store, keys: list[bytes], i: int, mutate) -> str:
    name = str(BlobName(NS.key, i, keys[i]))
    store.backend.put(name, mutate(store.backend.get(name)))
    return name


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:-1] + bytes([b[-1] ^ 1]),
        lambda b: b[:30] + bytes([b[30] ^ 1]) + b[31:],
        lambda b: b[: len(b) // 2],
        lambda b: b"not a blob at all",
    ],
    ids=["payload-bit", "header-bit", "truncated", "garbage"],
)
def test_a_corrupt_blob_is_never_returned_and_is_quarantined(store: Store, mutate) -> None:
    tokens = tokens_for(8)
    keys = publish_all(store, tokens)
    name = corrupt(store, keys, 3, mutate)
    got = store.fetch(NS, tokens, keys, 0, 8)
    assert [bytes(p) for p in got] == [payload(i, keys) for i in range(3)]
    assert stored_depth(store, NS, keys) == 3
    assert not store.backend.exists(name)
    assert store.backend.exists(QUARANTINE_PREFIX + name)


def test_a_foreign_blob_under_a_right_name_is_rejected(store: Store) -> None:
    tokens = tokens_for(9)
    keys = publish_all(store, tokens)
    other_tokens = tokens_for(10)
    other_keys = publish_all(store, other_tokens)
    name = str(BlobName(NS.key, 2, keys[2]))
    store.backend.put(name, store.backend.get(str(BlobName(NS.key, 2, other_keys[2]))))
    assert len(store.fetch(NS, tokens, keys, 0, 8)) == 2


def test_a_missing_blob_ends_the_run_and_drops_its_entry(store: Store) -> None:
    tokens = tokens_for(11)
    keys = publish_all(store, tokens)
    store.backend.delete(str(BlobName(NS.key, 5, keys[5])))
    assert len(store.fetch(NS, tokens, keys, 0, 8)) == 5
    assert stored_depth(store, NS, keys) == 5


def test_fetch_touches_the_prefix_it_used(store: Store) -> None:
    tokens = tokens_for(12)
    keys = publish_all(store, tokens)
    hour_ago = time.time() - 3600  # as if published an hour ago (touch only ever moves a stamp forward)
    store.index.r.zadd(store.index.lru_key, {k.hex(): lru_score(hour_ago, depth) for depth, k in enumerate(keys)})
    published = store.index.get(keys[0]).accessed
    store.fetch(NS, tokens, keys, 0, 2)
    assert store.index.get(keys[1]).accessed > published
    assert store.index.get(keys[2]).accessed == published


def test_gc_keeps_the_most_recently_used_chains_whole(store: Store) -> None:
    chains = [tokens_for(100 + i) for i in range(4)]
    keys = [publish_all(store, t) for t in chains]
    per_chain = store.index.total_bytes() // 4
    for age, k in enumerate(keys):
        store.index.touch(k, now=time.time() + 10 + age)
    result = store.gc(max_bytes=2 * per_chain)
    assert result.total_bytes <= 2 * per_chain
    assert result.evicted_chunks == 16
    assert [stored_depth(store, NS, k) for k in keys] == [0, 0, 8, 8]
    assert store.index.total_bytes() == sum(o.size for o in store.backend.list("chunks/"))


def test_gc_evicts_deepest_chunks_first_so_no_chain_has_a_hole(store: Store) -> None:
    tokens = tokens_for(13)
    keys = publish_all(store, tokens)
    size = store.index.total_bytes() // 8
    store.gc(max_bytes=size * 3)
    assert stored_depth(store, NS, keys) == 3
    assert store.index.count() == 3


def test_automatic_budget_applies_on_publish(backend, index) -> None:
    with Store(backend, index, max_bytes=0) as s:
        publish_all(s, tokens_for(14))
        assert s.index.total_bytes() == 0
    with Store(backend, index, max_bytes=10**9) as s:
        keys = publish_all(s, tokens_for(14))
        assert stored_depth(s, NS, keys) == 8


def test_reindex_rebuilds_after_redis_loses_everything(store: Store) -> None:
    a, b = tokens_for(15), tokens_for(16)
    ka, kb = publish_all(store, a), publish_all(store, b)
    total = store.index.total_bytes()
    store.backend.put(QUARANTINE_PREFIX + "junk", b"x")
    store.index.r.flushdb()
    assert stored_depth(store, NS, ka) == 0
    assert store.reindex() == 16
    assert stored_depth(store, NS, ka) == 8 and stored_depth(store, NS, kb) == 8
    assert store.index.total_bytes() == total
    store.gc(max_bytes=total * 3 // 4)
    assert stored_depth(store, NS, ka) == stored_depth(store, NS, kb) == 6
    assert len(store.fetch(NS, a, ka, 0, 8)) == 6


def test_verify_finds_bad_blobs_and_repairs(store: Store) -> None:
    tokens = tokens_for(17)
    keys = publish_all(store, tokens)
    bad = corrupt(store, keys, 6, lambda b: b[:-1] + bytes([b[-1] ^ 1]))
    store.backend.delete(str(BlobName(NS.key, 7, keys[7])))
    report = store.verify()
    assert report.checked == 8 and [n for n, _ in report.bad] == [bad] and len(report.missing) == 1
    store.verify(repair=True)
    clean = store.verify()
    assert clean.checked == 6 and not clean.bad and not clean.missing


def test_stats(store: Store) -> None:
    publish_all(store, tokens_for(18))
    publish_all(store, tokens_for(18), Namespace("fp2", NS.layout, NS.chunk_size))
    s = store.stats()
    assert s["chunks"] == 16 and s["namespaces"] == 2 and s["deepest_chunk"] == 8
    assert s["bytes"] == sum(o.size for o in store.backend.list("chunks/"))


def test_metrics_count_hits_misses_and_corruption(store: Store) -> None:
    from prometheus_client import REGISTRY

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    tokens = tokens_for(19)
    keys = publish_all(store, tokens)
    hits, misses = value("kvpool_store_chunks_total", result="hit"), value("kvpool_store_chunks_total", result="miss")
    corrupt_before = value("kvpool_store_corrupt_blobs_total", reason="corrupt")
    longer = np.concatenate([tokens, tokens_for(20, 16)])
    assert stored_depth(store, NS, NS.chain(longer)) == 8
    assert value("kvpool_store_chunks_total", result="hit") == hits + 8
    assert value("kvpool_store_chunks_total", result="miss") == misses + 2
    corrupt(store, keys, 0, lambda b: b[:-1] + bytes([b[-1] ^ 1]))
    store.fetch(NS, tokens, keys, 0, 1)
    assert value("kvpool_store_corrupt_blobs_total", reason="corrupt") == corrupt_before + 1
    assert value("kvpool_store_bytes_written_total") > 0
    assert value("kvpool_store_request_seconds_count", op="get") > 0
