"""Tails: a prompt's partial last chunk, stored so that any worker resumes at the exact token.

On each backend, with a real redis-server: a tail is found in the same lookup as the
chunks, serves every prompt that shares its first tokens (and only that far), is
verified like a chunk, goes first under eviction, and is kept to a few per chunk.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from store.blob import BlobName, decode_blob, encode_blob, verify_blob
from store.chain import CacheFormat, Namespace, chunk_key, tail_key
from store.errors import BlobMismatch
from store.maintenance import QUARANTINE_PREFIX
from store.store import Store
from store.tails import best_tail

NS = Namespace("fp", CacheFormat.of("f16", "f16", False), chunk_size=8)


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n)


def publish(store: Store, tokens: np.ndarray) -> list[bytes]:
    """Every full chunk of ``tokens`` and its tail, with payloads that name what they hold."""
    keys = NS.chain(tokens)
    store.publish(NS, tokens, keys, {i: b"chunk%d" % i for i in range(len(keys))})
    if len(tokens) % NS.chunk_size:
        store.publish_tail(NS, tokens, keys, b"tail of %d" % len(tokens))
    return keys


def test_a_tail_key_is_never_a_chunk_key() -> None:
    tokens = prompt(0, 8)
    assert tail_key(NS.key, tokens) != chunk_key(NS.key, tokens)
    assert tail_key(NS.key, tokens[:7]) != tail_key(NS.key, tokens[:6])


def test_the_same_lookup_finds_the_chunks_and_the_tail(store: Store) -> None:
    tokens = prompt(1, 29)
    keys = publish(store, tokens)
    hit = store.find(NS, tokens, keys)
    assert (hit.depth, hit.tokens) == (3, 29)
    got = store.fetch_prefix(NS, tokens, keys, 0, hit)
    assert [bytes(p) for p in got.chunks] == [b"chunk0", b"chunk1", b"chunk2"]
    assert bytes(got.tail) == b"tail of 29"


def test_a_tail_serves_a_longer_prompt_and_one_that_parts_from_it_midway(store: Store) -> None:
    tokens = prompt(2, 21)
    publish(store, tokens)
    longer = np.concatenate([tokens, prompt(3, 30)])
    assert store.find(NS, longer, NS.chain(longer)).tokens == 21, "the tail, then the new tokens"
    parted = tokens.copy()
    parted[19] += 1
    assert store.find(NS, parted, NS.chain(parted)).tokens == 19, "up to where the prompts part, never past it"
    other = prompt(4, 21)
    assert store.find(NS, other, NS.chain(other)).tokens == 0


def test_of_several_tails_the_one_that_agrees_longest_wins() -> None:
    rest = [5, 6, 7, 8]
    tails = {b"a": np.array([5, 6, 9]), b"b": np.array([5, 6, 7, 1, 1]), b"c": np.array([5, 6, 7, 2])}
    best = best_tail(tails, rest)
    assert best is not None and (best.key, best.usable) == (b"c", 3), "three tokens agree; the shorter tail is cheaper"
    assert best_tail(tails, [9]) is None and best_tail({}, rest) is None


def test_a_corrupt_tail_is_rejected_and_quarantined_like_a_chunk(store: Store) -> None:
    tokens = prompt(5, 13)
    keys = publish(store, tokens)
    hit = store.find(NS, tokens, keys)
    assert hit.tail is not None
    name = str(BlobName(NS.key, 1, hit.tail.key, tail=True))
    blob = store.backend.get(name)
    store.backend.put(name, blob[:-1] + bytes([blob[-1] ^ 1]))
    got = store.fetch_prefix(NS, tokens, keys, 0, hit)
    assert len(got.chunks) == 1 and got.tail is None
    assert store.find(NS, tokens, keys).tokens == 8, "the bad tail is gone from the index"
    assert list(store.backend.list(QUARANTINE_PREFIX + name))


def test_a_tail_blob_is_verified_as_a_tail_at_its_exact_position() -> None:
    tokens = prompt(6, 5)
    data = encode_blob(NS.key, 0, NS.key, tokens, b"cells", tail=True)
    header, payload = decode_blob(data)
    assert header.tail and bytes(payload) == b"cells"
    key = tail_key(NS.key, tokens)
    assert bytes(verify_blob(data, namespace=NS.key, index=0, parent=NS.key, key=key, tokens=tokens, tail=True)) == b"cells"
    with pytest.raises(BlobMismatch, match="tail"):
        verify_blob(data, namespace=NS.key, index=0, parent=NS.key, key=key, tokens=tokens)
    with pytest.raises(BlobMismatch):
        verify_blob(data, namespace=NS.key, index=0, parent=NS.key, key=key, tokens=tokens[:4], tail=True)


def test_a_lost_tail_blob_is_dropped_and_the_chunks_still_serve(store: Store) -> None:
    tokens = prompt(7, 20)
    keys = publish(store, tokens)
    hit = store.find(NS, tokens, keys)
    assert hit.tail is not None
    store.backend.delete(str(BlobName(NS.key, 2, hit.tail.key, tail=True)))
    got = store.fetch_prefix(NS, tokens, keys, 0, hit)
    assert len(got.chunks) == 2 and got.tail is None
    assert store.find(NS, tokens, keys).tokens == 16
    assert store.publish_tail(NS, tokens, keys, b"again"), "the next publish stores it again"


def test_tails_go_first_under_gc(store: Store) -> None:
    """Of entries last used at the same time, eviction takes the tails before any chunk."""
    a, b = prompt(8, 20), prompt(9, 20)
    ka, kb = publish(store, a), publish(store, b)
    now = time.time() + 60
    for tokens, keys in ((a, ka), (b, kb)):
        hit = store.find(NS, tokens, keys)
        assert hit.tail is not None
        store.index.touch(keys, now=now, tail=hit.tail.key)
    tail_bytes = sum(o.size for o in store.backend.list("tails/"))
    chunk_bytes = sum(o.size for o in store.backend.list("chunks/"))
    assert store.index.total_bytes() == tail_bytes + chunk_bytes
    store.gc(max_bytes=chunk_bytes)
    assert store.find(NS, a, ka).tokens == 16 and store.find(NS, b, kb).tokens == 16, "both tails went, no chunk did"
    assert list(store.backend.list("tails/")) == [] and store.index.total_bytes() == chunk_bytes


def test_each_chunk_keeps_its_most_recently_used_tails(backend, index) -> None:
    with Store(backend, index, tails_per_chunk=2) as store:
        base = prompt(10, 8)
        asks = [np.concatenate([base, [100 + i, 7]]) for i in range(3)]
        publish(store, asks[0])
        publish(store, asks[1])
        first = store.find(NS, asks[0], NS.chain(asks[0])).tail
        assert first is not None
        store.index.touch(NS.chain(base), now=time.time() + 60, tail=first.key)  # the first tail is used again
        publish(store, asks[2])
        kept = [store.find(NS, t, NS.chain(t)).tokens for t in asks]
        assert kept == [10, 8, 10], "the least recently used tail was pushed out; its prompt still finds the chunk"
        assert len(list(store.backend.list("tails/"))) == 2


def test_reindex_drops_tails_and_keeps_chunks(store: Store) -> None:
    tokens = prompt(11, 30)
    keys = publish(store, tokens)
    store.index.r.flushdb()
    assert store.reindex() == 3
    assert store.find(NS, tokens, keys).tokens == 24
    assert list(store.backend.list("tails/")) == []
    assert store.index.total_bytes() == sum(o.size for o in store.backend.list("chunks/"))


def test_verify_checks_tails_too(store: Store) -> None:
    tokens = prompt(12, 12)
    keys = publish(store, tokens)
    hit = store.find(NS, tokens, keys)
    assert hit.tail is not None
    name = str(BlobName(NS.key, 1, hit.tail.key, tail=True))
    store.backend.put(name, b"junk")
    report = store.verify()
    assert report.checked == 2 and [n for n, _ in report.bad] == [name]
    assert store.stats()["tails"] == 1


def test_a_prompt_that_parts_from_another_inside_its_last_full_chunk_resumes_where_they_part(store: Store) -> None:
    """A document asked a second question: the first prompt's last full chunk ends past where the two part."""
    first = prompt(13, 30)  # chunks 0..2 full; the document is its first 21 tokens
    publish(store, first)
    second = np.concatenate([first[:21], prompt(14, 6)])
    keys = NS.chain(second)
    hit = store.find(NS, second, keys)
    assert hit.depth == 2 and hit.tail is not None and hit.tail.full, "chunk 2 of the first prompt is offered as a candidate"
    assert hit.tokens == 21 + int(first[21] == second[21])
    got = store.fetch_prefix(NS, second, keys, 0, hit)
    assert len(got.chunks) == 2 and bytes(got.tail) == b"chunk2", "verified as the full chunk it is"
    assert store.index.count() == 4, "three chunks and the first prompt's tail; the candidate is no extra entry"


def test_evicting_a_chunk_that_is_a_candidate_forgets_the_candidate(store: Store) -> None:
    first = prompt(15, 24)
    keys = publish(store, first)
    store.index.remove([keys[2]])
    second = np.concatenate([first[:20], prompt(16, 4)])
    assert store.find(NS, second, NS.chain(second)).tokens == 16, "no candidate points at a chunk that is gone"
