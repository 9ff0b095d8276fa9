"""One suite, run against every blob backend (local directory and S3 over HTTP)."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from store.backends import BlobBackend
from store.errors import BlobMissing


def test_put_get_round_trip(backend: BlobBackend) -> None:
    backend.put("chunks/v1/a/000000-x", b"hello")
    assert backend.get("chunks/v1/a/000000-x") == b"hello"


def test_get_missing_raises_blob_missing(backend: BlobBackend) -> None:
    with pytest.raises(BlobMissing):
        backend.get("chunks/v1/nope")


def test_exists_and_delete(backend: BlobBackend) -> None:
    assert not backend.exists("k")
    backend.put("k", b"1")
    assert backend.exists("k")
    backend.delete("k")
    assert not backend.exists("k")
    backend.delete("k")


def test_put_overwrites(backend: BlobBackend) -> None:
    backend.put("k", b"old")
    backend.put("k", b"new")
    assert backend.get("k") == b"new"


def test_list_by_prefix_with_sizes(backend: BlobBackend) -> None:
    backend.put("chunks/v1/n/000000-a", b"12345")
    backend.put("chunks/v1/n/000001-b", b"1")
    backend.put("quarantine/x", b"zz")
    listed = {o.name: o.size for o in backend.list("chunks/")}
    assert listed == {"chunks/v1/n/000000-a": 5, "chunks/v1/n/000001-b": 1}
    assert {o.name for o in backend.list()} == {"chunks/v1/n/000000-a", "chunks/v1/n/000001-b", "quarantine/x"}
    assert all(o.modified > 0 for o in backend.list())


def test_large_blob(backend: BlobBackend) -> None:
    data = bytes(range(256)) * (24 * 1024)
    backend.put("big", data)
    assert backend.get("big") == data


def test_concurrent_puts_of_the_same_blob(backend: BlobBackend) -> None:
    data = b"same bytes" * 1000
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: backend.put("same", data), range(16)))
    assert backend.get("same") == data
    assert [o.name for o in backend.list()] == ["same"]


def test_concurrent_gets(backend: BlobBackend) -> None:
    for i in range(16):
        backend.put(f"b{i}", bytes([i]) * 100)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: backend.get(f"b{i}"), range(16)))
    assert got == [bytes([i]) * 100 for i in range(16)]
