"""The Redis index: presence, depth of a chain, byte accounting and eviction order."""

from concurrent.futures import ThreadPoolExecutor

from store.chain import CacheFormat, Namespace
from store.index import RedisIndex, lru_score

NS = Namespace("fp", CacheFormat(), chunk_size=2)
KEYS = NS.chain(list(range(20)))


def test_deepest_counts_the_run_from_the_start(index: RedisIndex) -> None:
    assert index.deepest(KEYS) == 0
    for i in range(4):
        index.add(KEYS[i], NS.key, i, 100)
    assert index.deepest(KEYS) == 4
    assert index.deepest(KEYS[:3]) == 3
    assert index.deepest([]) == 0


def test_deepest_stops_at_a_hole(index: RedisIndex) -> None:
    for i in (0, 1, 3, 4, 5):
        index.add(KEYS[i], NS.key, i, 100)
    assert index.deepest(KEYS) == 2
    index.remove([KEYS[0]])
    assert index.deepest(KEYS) == 0


def test_bytes_are_counted_once_per_chunk(index: RedisIndex) -> None:
    assert index.add(KEYS[0], NS.key, 0, 100)
    assert not index.add(KEYS[0], NS.key, 0, 100)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: index.add(KEYS[1], NS.key, 1, 50), range(20)))
    assert sum(results) == 1
    assert index.total_bytes() == 150 and index.count() == 2
    assert index.remove([KEYS[0], KEYS[0], KEYS[5]]) == 100
    assert index.total_bytes() == 50


def test_entry_records_size_and_times(index: RedisIndex) -> None:
    index.add(KEYS[2], NS.key, 2, 123, now=1_700_000_000.0)
    e = index.get(KEYS[2])
    assert e is not None and (e.namespace, e.index, e.size, e.created, e.accessed) == (NS.key, 2, 123, 1.7e9, 1.7e9)
    index.touch(KEYS[:3], now=1_700_000_100.5)
    assert index.get(KEYS[2]).accessed == 1_700_000_100.5
    assert index.get(KEYS[9]) is None


def test_touch_does_not_resurrect_removed_entries(index: RedisIndex) -> None:
    index.add(KEYS[0], NS.key, 0, 10)
    index.remove([KEYS[0]])
    index.touch(KEYS[:2])
    assert index.deepest(KEYS) == 0 and index.count() == 0 and index.get(KEYS[0]) is None


def test_eviction_order_is_lru_chain_then_deepest_first(index: RedisIndex) -> None:
    other = Namespace("fp", CacheFormat(), chunk_size=2).chain(list(range(100, 120)))
    for i in range(3):
        index.add(KEYS[i], NS.key, i, 1, now=1.7e9)
        index.add(other[i], NS.key, i, 1, now=1.7e9)
    index.touch(other[:3], now=1.7e9 + 1)
    assert index.coldest(6) == [KEYS[2], KEYS[1], KEYS[0], other[2], other[1], other[0]]


def test_scores_never_put_a_parent_below_its_child() -> None:
    for t in (1.58e9, 1.7e9, 4.0e9):
        scores = [lru_score(t, d) for d in range(200)]
        assert scores == sorted(scores, reverse=True)
        assert lru_score(t + 0.02, 10_000) > lru_score(t, 0)
        assert all(s < 2**53 for s in scores)


def test_clear_removes_everything(index: RedisIndex) -> None:
    for i in range(5):
        index.add(KEYS[i], NS.key, i, 7)
    index.clear()
    assert index.count() == 0 and index.total_bytes() == 0 and list(index.entries()) == []
