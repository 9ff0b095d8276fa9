"""Batch records in Redis: each tenant pages through its own batches, newest first, without reading the others."""

from __future__ import annotations

import time

import redis

from gateway.batch.records import TENANT_BATCHES_PREFIX, Batches, RunnerLease
from gateway.tenants import Tenant

A, B = Tenant("a", "a" * 32), Tenant("b", "b" * 32)


def _pages(batches: Batches, tenant: Tenant, limit: int) -> list[tuple[list[str], bool]]:
    pages, after = [], None
    while True:
        recs, more = batches.list(tenant, limit, after)
        pages.append(([r["id"] for r in recs], more))
        if not more:
            return pages
        after = recs[-1]["id"]


def test_pages_cover_every_batch_once_newest_first(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    batches = Batches(conn)
    made = [batches.create(A, "file-x", "/v1/chat/completions", "24h", None)["id"] for _ in range(7)]
    batches.create(B, "file-y", "/v1/chat/completions", "24h", None)
    pages = _pages(batches, A, 3)
    assert [len(ids) for ids, _ in pages] == [3, 3, 1]
    assert [more for _, more in pages] == [True, True, False]
    listed = [i for ids, _ in pages for i in ids]
    assert sorted(listed) == sorted(made) and len(set(listed)) == 7
    assert listed == [i.decode() for i in conn.zrevrange(TENANT_BATCHES_PREFIX + A.salt[:24], 0, -1)]


def test_an_unknown_or_foreign_cursor_gives_an_empty_page(redis_url: str) -> None:
    batches = Batches(redis.Redis.from_url(redis_url))
    batches.create(A, "file-x", "/v1/completions", "24h", None)
    theirs = batches.create(B, "file-y", "/v1/completions", "24h", None)["id"]
    assert batches.list(A, 10, "batch_missing") == ([], False)
    assert batches.list(A, 10, theirs) == ([], False)


def test_a_lease_lost_to_another_gateway_is_neither_renewed_nor_released(redis_url: str) -> None:
    """Gateway A stalled past its lease and gateway B took the batch: A's renewal must not extend B's
    lease (A stops renewing and knows it lost the batch), and A's release must not delete it."""
    conn = redis.Redis.from_url(redis_url)
    a = RunnerLease(conn, "batch_lease", "gateway-a", lease_s=0.3)
    assert a.acquire()
    assert conn.get(a.key) == b"gateway-a"
    conn.delete(a.key)  # A's lease ran out while it stalled
    b = RunnerLease(conn, "batch_lease", "gateway-b", lease_s=30)
    assert b.acquire()
    assert a.lost.wait(10), "A's next renewal finds the lease is no longer its own"
    assert conn.get(b.key) == b"gateway-b" and conn.pttl(b.key) > 10_000, "B's lease is untouched"
    a.release()
    assert conn.get(b.key) == b"gateway-b", "A's release leaves B's lease alone"
    assert not b.lost.is_set()
    b.release()
    assert not conn.exists(b.key)


def test_a_held_lease_is_renewed_until_released(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    lease = RunnerLease(conn, "batch_renewed", "gateway-a", lease_s=3)  # renewed every second
    assert lease.acquire()
    assert not RunnerLease(conn, "batch_renewed", "gateway-b", lease_s=3).acquire()
    conn.pexpire(lease.key, 2000)  # two thirds gone: only a renewal brings it back to 3 s
    deadline = time.monotonic() + 10
    while conn.pttl(lease.key) <= 2000:
        assert time.monotonic() < deadline, "the lease was not renewed"
        time.sleep(0.05)
    assert conn.get(lease.key) == b"gateway-a" and not lease.lost.is_set()
    lease.release()
    assert not conn.exists(lease.key)
