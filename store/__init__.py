"""The content-addressed prompt-state store: chain hashing, the blob format, blob backends and the Redis index."""

from store.errors import (
    BlobCorrupt,
    BlobMismatch,
    BlobMissing,
    StoreError,
    StoreUnavailable,
)

__all__ = ["StoreError", "StoreUnavailable", "BlobCorrupt", "BlobMismatch", "BlobMissing"]
