"""A blob backend on S3 (MinIO in deployment), reached through boto3 with an endpoint URL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from store.backends.base import ObjectInfo
from store.errors import BlobMissing, StoreUnavailable

if TYPE_CHECKING:
    from store.settings import StoreSettings

_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_NO_BUCKET = "NoSuchBucket"
"""A bucket that vanished (an S3 that came back empty) is data lost, not an outage: its blobs read as missing."""


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def s3_client(settings: StoreSettings) -> Any:
    """A boto3 S3 client with the endpoint, credentials and bounded timeouts and retries from ``settings``."""
    return boto3.session.Session().client(
        "s3",
        endpoint_url=settings.s3_endpoint_url,
        region_name=settings.s3_region,
        aws_access_key_id=settings.s3_access_key_id,
        aws_secret_access_key=settings.s3_secret_access_key,
        config=Config(
            connect_timeout=settings.connect_timeout_s,
            read_timeout=settings.read_timeout_s,
            retries={"max_attempts": settings.retries + 1, "mode": "standard"},
            max_pool_connections=max(10, settings.io_threads * 2),
            s3={"addressing_style": "path"},
        ),
    )


class S3Backend:
    """Blobs as objects under ``prefix`` in ``bucket``.

    Timeouts and retries are bounded (see `StoreSettings`) so that an unreachable
    endpoint surfaces as `StoreUnavailable` within seconds instead of hanging a worker.
    """

    def __init__(self, client: Any, bucket: str, prefix: str = "", *, create_bucket: bool = False) -> None:
        if not bucket:
            raise ValueError("an S3 store URL needs a bucket: s3://bucket[/prefix]")
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint = f"{client.meta.endpoint_url}/{bucket}/{self.prefix}"
        self.create_bucket = create_bucket
        if create_bucket:
            self._ensure_bucket()

    @classmethod
    def from_settings(cls, settings: StoreSettings, *, bucket: str, prefix: str = "") -> S3Backend:
        return cls(s3_client(settings), bucket, prefix, create_bucket=settings.s3_create_bucket)

    def _unavailable(self, e: Exception) -> StoreUnavailable:
        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            return StoreUnavailable(self.endpoint, f"{err.get('Code', '?')}: {err.get('Message', e)}")
        return StoreUnavailable(self.endpoint, f"{type(e).__name__}: {e}")

    def _ensure_bucket(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as e:
            if _code(e) not in _MISSING_CODES | {_NO_BUCKET}:
                raise self._unavailable(e) from e
        except BotoCoreError as e:
            raise self._unavailable(e) from e
        try:
            self.client.create_bucket(Bucket=self.bucket)
        except ClientError as e:
            if _code(e) not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                raise self._unavailable(e) from e
        except BotoCoreError as e:
            raise self._unavailable(e) from e

    def get(self, name: str) -> bytes:
        try:
            data: bytes = self.client.get_object(Bucket=self.bucket, Key=self.prefix + name)["Body"].read()
            return data
        except ClientError as e:
            if _code(e) in _MISSING_CODES | {_NO_BUCKET}:
                raise BlobMissing(name) from None
            raise self._unavailable(e) from e
        except BotoCoreError as e:
            raise self._unavailable(e) from e

    def put(self, name: str, data: bytes) -> None:
        """Write a blob; a bucket that vanished is created again first, where the settings allow it."""
        for attempt in (1, 2):
            try:
                self.client.put_object(Bucket=self.bucket, Key=self.prefix + name, Body=data)
                return
            except ClientError as e:
                if _code(e) != _NO_BUCKET or not self.create_bucket or attempt == 2:
                    raise self._unavailable(e) from e
            except BotoCoreError as e:
                raise self._unavailable(e) from e
            self._ensure_bucket()

    def exists(self, name: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.prefix + name)
            return True
        except ClientError as e:
            if _code(e) in _MISSING_CODES | {_NO_BUCKET}:
                return False
            raise self._unavailable(e) from e
        except BotoCoreError as e:
            raise self._unavailable(e) from e

    def delete(self, name: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.prefix + name)
        except ClientError as e:
            if _code(e) != _NO_BUCKET:
                raise self._unavailable(e) from e
        except BotoCoreError as e:
            raise self._unavailable(e) from e

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for obj in page.get("Contents", []):
                    yield ObjectInfo(obj["Key"][len(self.prefix) :], obj["Size"], obj["LastModified"].timestamp())
        except ClientError as e:
            if _code(e) != _NO_BUCKET:
                raise self._unavailable(e) from e
        except BotoCoreError as e:
            raise self._unavailable(e) from e
