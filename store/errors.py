"""Exceptions raised by the store. Callers catch `StoreError` for all of them::

StoreError
├── StoreUnavailable   the backend or Redis cannot be reached (names the endpoint)
├── BlobMissing        no blob under that name
├── BlobCorrupt        bytes that are not a well-formed, self-consistent blob
└── BlobMismatch       a sound blob, but not the one expected at this chain position
"""


class StoreError(Exception):
    """Base class of every error the store raises."""


class StoreUnavailable(StoreError):
    """A backend (S3, the filesystem) or the Redis index cannot be reached. The message names the endpoint."""

    def __init__(self, endpoint: str, reason: str) -> None:
        super().__init__(f"store unavailable: {endpoint}: {reason}")
        self.endpoint = endpoint
        self.reason = reason


class BlobMissing(StoreError):
    """The backend holds no object under this name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"blob missing: {name}")
        self.name = name


class BlobCorrupt(StoreError):
    """The bytes are not a well-formed blob: bad magic or version, truncated, or a checksum fails."""


class BlobMismatch(StoreError):
    """A well-formed blob that belongs elsewhere: another namespace, chain position, parent or tokens."""
