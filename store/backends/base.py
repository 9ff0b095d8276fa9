"""The interface every blob backend implements."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


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
