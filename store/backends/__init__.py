"""Blob backends: where blobs live (a local folder, or S3), behind one interface, and how settings pick one.

`base` holds the interface (`BlobBackend`) and the listing record (`ObjectInfo`); `fs` and
`s3` implement it; `open_backend` picks one from the settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from store.backends.base import BlobBackend, ObjectInfo

if TYPE_CHECKING:
    from store.settings import StoreSettings

__all__ = ["BlobBackend", "ObjectInfo", "open_backend"]


def open_backend(settings: StoreSettings) -> BlobBackend:
    """``s3://bucket/prefix`` selects S3; anything else is a local directory."""
    url = settings.resolved_store_url()
    if url.startswith("s3://"):
        from store.backends.s3 import S3Backend

        bucket, _, prefix = url[len("s3://") :].partition("/")
        return S3Backend.from_settings(settings, bucket=bucket, prefix=prefix)
    from store.backends.fs import FsBackend

    return FsBackend(url.removeprefix("file://"))
