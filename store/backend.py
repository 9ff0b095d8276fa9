"""The interface every blob backend implements, and how settings pick one."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from store.settings import StoreSettings


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int
    modified: float


@runtime_checkable
class BlobBackend(Protocol):
    """Flat key/value storage of immutable blobs. Implementations are thread-safe.

    Every method raises `StoreUnavailable` (naming the endpoint) when the storage cannot
    be reached; `get` raises `BlobMissing` for an absent name.
    """

    endpoint: str

    def get(self, name: str) -> bytes: ...

    def put(self, name: str, data: bytes) -> None: ...

    def exists(self, name: str) -> bool: ...

    def delete(self, name: str) -> None: ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]: ...


def open_backend(settings: StoreSettings) -> BlobBackend:
    """``s3://bucket/prefix`` selects S3; anything else is a local directory."""
    url = settings.resolved_store_url()
    if url.startswith("s3://"):
        from store.s3 import S3Backend

        bucket, _, prefix = url[len("s3://") :].partition("/")
        return S3Backend.from_settings(settings, bucket=bucket, prefix=prefix)
    from store.fs import FsBackend

    return FsBackend(url.removeprefix("file://"))
