"""Batch records in Redis: each tenant pages through its own batches, newest first, without reading the others."""

from __future__ import annotations

import redis

from gateway.batch.records import TENANT_BATCHES_PREFIX, Batches
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
