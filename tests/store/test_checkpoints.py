"""Whole-state checkpoints in the store, on each backend: the deepest on a chain, verified fetch, eviction before chunks."""

import time

import numpy as np

from store.blob import BlobName
from store.chain import CHECKPOINT_EXTRA, CacheFormat, Namespace
from store.checkpoints import Checkpoints, checkpoint_key, checkpoint_name
from store.maintenance import QUARANTINE_PREFIX
from store.store import Store
from tests.helpers import stored_depth

CELLS = Namespace("fp", CacheFormat.of("f16", "f16", False), chunk_size=8)
WHOLE = Namespace("fp", CacheFormat.of("f16", "f16", False, dict([CHECKPOINT_EXTRA])), chunk_size=8)


def tokens_for(seed: int, n: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n)


def state(depth: int) -> bytes:
    """A stand-in for the whole state after ``depth`` chunks (it grows with them, like a window model's)."""
    return bytes([depth]) * (1000 + 100 * depth)


def test_checkpoints_live_in_a_namespace_of_their_own() -> None:
    tokens = tokens_for(0)
    assert WHOLE.key != CELLS.key
    assert not set(WHOLE.chain(tokens)) & set(CELLS.chain(tokens)), "a checkpoint key never names a chunk of cells"


def test_the_deepest_checkpoint_on_a_chain_is_found_whatever_holes_lie_before_it(store: Store) -> None:
    ck = Checkpoints(store)
    tokens = tokens_for(1)
    keys = WHOLE.chain(tokens)
    assert ck.publish(WHOLE, tokens, keys, {2: state(2), 5: state(5)}) == 2
    assert ck.deepest(keys) == 5
    assert ck.deepest(keys[:4]) == 2, "a prompt that parts from the chain in chunk 5 gets the one before"
    assert ck.deepest(keys[:1]) == 0
    assert ck.missing(WHOLE, tokens, keys, [16, 24, 40, 48]) == [24, 48]
    assert bytes(ck.fetch(WHOLE, tokens, keys, 5) or b"") == state(5)
    assert ck.publish(WHOLE, tokens, keys, {2: state(2), 5: state(5)}) == 0, "publishing again adds nothing"


def test_a_checkpoint_is_fetched_only_for_the_exact_tokens_it_was_published_for(store: Store) -> None:
    ck = Checkpoints(store)
    tokens = tokens_for(2)
    keys = WHOLE.chain(tokens)
    ck.publish(WHOLE, tokens, keys, {3: state(3)})
    other = tokens.copy()
    other[20] += 1  # inside the checkpoint's last chunk: the key differs, and so must the blob
    assert ck.fetch(WHOLE, other, keys, 3) is None
    assert store.backend.get(f"{QUARANTINE_PREFIX}{BlobName(WHOLE.key, 2, keys[2])}")
    assert ck.deepest(keys) == 0, "a blob that fails verification leaves the index"


def test_a_corrupted_or_missing_checkpoint_is_dropped_not_loaded(store: Store) -> None:
    ck = Checkpoints(store)
    tokens = tokens_for(3)
    keys = WHOLE.chain(tokens)
    ck.publish(WHOLE, tokens, keys, {2: state(2), 4: state(4)})
    name = str(BlobName(WHOLE.key, 3, keys[3]))
    blob = bytearray(store.backend.get(name))
    blob[-10] ^= 0xFF
    store.backend.put(name, bytes(blob))
    assert ck.fetch(WHOLE, tokens, keys, 4) is None
    assert ck.deepest(keys) == 2
    store.backend.delete(str(BlobName(WHOLE.key, 1, keys[1])))
    assert ck.fetch(WHOLE, tokens, keys, 2) is None
    assert ck.deepest(keys) == 0


def test_checkpoints_go_before_chunks_used_at_the_same_time_under_gc(store: Store) -> None:
    cells, whole = tokens_for(4), tokens_for(5)
    cell_keys, whole_keys = CELLS.chain(cells), WHOLE.chain(whole)
    store.publish(CELLS, cells, cell_keys, {i: b"c" * 1500 for i in range(len(cell_keys))})
    Checkpoints(store).publish(WHOLE, whole, whole_keys, {d: state(d) for d in (2, 4, 6)})
    later = time.time() + 60
    store.index.touch(cell_keys, now=later)
    for d in (2, 4, 6):
        store.index.touch([], tail=whole_keys[d - 1], now=later)
    checkpoint_bytes = sum(store.index.get(whole_keys[d - 1]).size for d in (2, 4, 6))  # type: ignore[union-attr]
    store.gc(max_bytes=store.index.total_bytes() - checkpoint_bytes)
    assert Checkpoints(store).deepest(whole_keys) == 0, "every checkpoint went first"
    assert stored_depth(store, CELLS, cell_keys) == len(cell_keys), "and no chunk went"


def test_reindex_brings_checkpoints_back_as_leaves(store: Store) -> None:
    whole = tokens_for(6)
    keys = WHOLE.chain(whole)
    Checkpoints(store).publish(WHOLE, whole, keys, {2: state(2), 4: state(4)})
    store.index.r.flushdb()
    store.index.describe(WHOLE.key, {"layout": WHOLE.layout.canonical()})  # what a publisher records beside its namespace
    assert store.reindex() == 2
    assert Checkpoints(store).deepest(keys) == 4
    assert bytes(Checkpoints(store).fetch(WHOLE, whole, keys, 4) or b"") == state(4)
    cells = tokens_for(7)
    cell_keys = CELLS.chain(cells)
    store.publish(CELLS, cells, cell_keys, {i: b"c" * 1500 for i in range(len(cell_keys))})
    later = time.time() + 60
    store.index.touch(cell_keys, now=later)
    store.index.touch([], tail=keys[1], now=later)
    store.index.touch([], tail=keys[3], now=later)
    store.gc(max_bytes=store.index.total_bytes() - sum(store.index.get(k).size for k in (keys[1], keys[3])))  # type: ignore[union-attr]
    assert Checkpoints(store).deepest(keys) == 0 and stored_depth(store, CELLS, cell_keys) == len(cell_keys)


def test_a_tail_checkpoint_serves_only_a_prompt_that_continues_with_all_of_its_tokens(store: Store) -> None:
    ck = Checkpoints(store)
    tokens = tokens_for(8)
    keys = WHOLE.chain(tokens)
    ck.publish(WHOLE, tokens, keys, {2: state(2)})
    assert ck.publish_tail(WHOLE, tokens, keys, 29, state(29)) is True  # after 3 chunks and 5 tokens
    assert ck.publish_tail(WHOLE, tokens, keys, 29, state(29)) is False
    assert ck.missing(WHOLE, tokens, keys, [16, 29, 30]) == [30]

    found = ck.find(WHOLE, tokens, keys, limit=62)
    assert (found.depth, found.tokens) == (3, 29), "the resent prompt resumes where the last one stopped"
    assert bytes(ck.fetch_found(WHOLE, tokens, keys, found) or b"") == state(29)
    assert ck.find(WHOLE, tokens, keys, limit=28).tokens == 16, "a tail past the limit is not used"
    parted = tokens.copy()
    parted[27] += 1  # the prompt parts from the tail inside it: a tail checkpoint serves whole or not at all
    assert ck.find(WHOLE, parted, WHOLE.chain(parted), limit=62).tokens == 16


def test_a_corrupted_tail_checkpoint_gives_way_to_the_boundary_before_it(store: Store) -> None:
    ck = Checkpoints(store)
    tokens = tokens_for(9)
    keys = WHOLE.chain(tokens)
    ck.publish(WHOLE, tokens, keys, {3: state(3)})
    ck.publish_tail(WHOLE, tokens, keys, 43, state(43))
    name = str(checkpoint_name(WHOLE, tokens, keys, 43))
    blob = bytearray(store.backend.get(name))
    blob[-3] ^= 0x01
    store.backend.put(name, bytes(blob))
    found = ck.find(WHOLE, tokens, keys, limit=62)
    assert found.tokens == 43 and ck.fetch_found(WHOLE, tokens, keys, found) is None
    assert ck.find(WHOLE, tokens, keys, limit=62).tokens == 24, "the bad tail left the index"
    assert store.backend.get(QUARANTINE_PREFIX + name)


def test_a_conversations_older_tail_checkpoints_are_superseded_by_a_turn_that_resumed_past_them(store: Store) -> None:
    """Turns of one chat resend its history: once a turn that resumed after 45 tokens stored its own end, the tails
    before 45 go (blob and index, before a boundary checkpoint too), the one it resumed from stays, and so do boundaries
    and other conversations' tails."""
    ck = Checkpoints(store)
    tokens = tokens_for(10)
    keys = WHOLE.chain(tokens)
    other = tokens.copy()
    other[20] += 1  # another conversation, parting from this one in its third chunk
    other_keys = WHOLE.chain(other)
    ck.publish(WHOLE, tokens, keys, {2: state(2)})
    for end in (13, 19, 29, 45, 61):  # 13: before the boundary checkpoint after 16
        ck.publish_tail(WHOLE, tokens, keys, end, state(end))
    ck.publish_tail(WHOLE, other, other_keys, 29, state(29))
    before = store.index.total_bytes()
    old = [store.index.get(checkpoint_key(WHOLE, tokens, keys, end)) for end in (13, 19, 29)]
    assert all(old)

    assert ck.supersede(WHOLE, tokens, keys, 45) == 3, "the tails after 13, 19 and 29 tokens"
    assert ck.missing(WHOLE, tokens, keys, [13, 16, 19, 29, 45, 61]) == [13, 19, 29]
    assert store.index.total_bytes() == before - sum(e.size for e in old if e is not None)
    for end in (13, 19, 29):
        assert not store.backend.exists(str(checkpoint_name(WHOLE, tokens, keys, end))), "the blob is deleted too"
    assert ck.find(WHOLE, other, other_keys, limit=62).tokens == 29, "another conversation's tail is not this one's to drop"
    assert ck.find(WHOLE, tokens, keys, limit=50).tokens == 45
    assert ck.supersede(WHOLE, tokens, keys, 45) == 0
