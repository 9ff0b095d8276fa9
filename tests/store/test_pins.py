"""Pins: a prefix a client asked to keep (``cache_control``) is not evicted before its pin runs out, then ages like any entry."""

from __future__ import annotations

import time

from store.chain import tail_key
from store.store import Store
from tests.helpers import stored_depth
from tests.store.test_store import NS, payload, publish_all, tokens_for


def test_eviction_skips_a_pinned_prefix_until_its_pin_runs_out(store: Store) -> None:
    kept, other = tokens_for(1), tokens_for(2)
    kept_keys, other_keys = publish_all(store, kept), publish_all(store, other)
    store.index.touch(other_keys, now=time.time() + 5)  # used more recently than the pinned prefix was
    now = time.time()
    store.pin(NS, kept[:20], now + 300)  # two full chunks and a tail of 4
    store.publish_tail(NS, kept[:20], kept_keys[:2], payload(2, kept_keys))
    store.pin(NS, kept[:20], now + 300)

    result = store.gc(0)
    assert stored_depth(store, NS, other_keys) == 0 and result.total_bytes > 0
    assert stored_depth(store, NS, kept_keys) == 2, "the pinned chunks stay, even over budget; the unpinned rest of the chain goes"
    tail = tail_key(kept_keys[1], kept[16:20])
    assert store.index.contains(tail)
    assert {store.index.get(k).pinned_until for k in [*kept_keys[:2], tail]} == {now + 300}

    store.gc(0, now=now + 301)
    assert store.index.count() == 0


def test_a_pin_only_lengthens_and_never_indexes_what_is_not_stored(store: Store) -> None:
    tokens = tokens_for(3)
    keys = publish_all(store, tokens)
    now = time.time()
    store.pin(NS, tokens[:16], now + 3600)
    store.pin(NS, tokens[:16], now + 300)
    assert store.index.get(keys[0]).pinned_until == now + 3600
    assert store.index.get(keys[2]).pinned_until == 0.0
    store.pin(NS, tokens_for(4)[:16], now + 300)  # a prefix never published
    assert store.index.count() == len(keys)
