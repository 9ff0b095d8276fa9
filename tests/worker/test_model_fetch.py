"""Models in the bucket are fetched once into the local cache and refreshed when the object changes."""

from __future__ import annotations

import os
from pathlib import Path

import boto3
import pytest

from store.errors import StoreUnavailable
from tests.conftest import s3_settings
from tests.services import S3Server
from worker.model_fetch import fetch_model


def s3(settings):
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint_url,
        aws_access_key_id=settings.s3_access_key_id,
        aws_secret_access_key=settings.s3_secret_access_key,
        region_name="us-east-1",
    )


def test_fetch_caches_and_refreshes(s3_server: S3Server, redis_url: str, tmp_path: Path, tiny_model: Path) -> None:
    settings = s3_settings(s3_server.endpoint_url, "models", redis_url, state_dir=tmp_path)
    client = s3(settings)
    client.create_bucket(Bucket="models")
    client.upload_file(str(tiny_model), "models", "m/tiny.gguf")

    local = fetch_model("s3://models/m/tiny.gguf", settings)
    assert local.read_bytes() == tiny_model.read_bytes()
    stamp = local.stat().st_mtime_ns
    assert fetch_model("s3://models/m/tiny.gguf", settings).stat().st_mtime_ns == stamp

    client.put_object(Bucket="models", Key="m/tiny.gguf", Body=b"GGUF-changed")
    assert fetch_model("s3://models/m/tiny.gguf", settings).read_bytes() == b"GGUF-changed"
    assert not [p for p in local.parent.iterdir() if p.name.startswith(".download-")]


def test_missing_model_and_bad_url(s3_server: S3Server, redis_url: str, tmp_path: Path) -> None:
    settings = s3_settings(s3_server.endpoint_url, "models2", redis_url, state_dir=tmp_path)
    s3(settings).create_bucket(Bucket="models2")
    with pytest.raises(FileNotFoundError, match="model not found"):
        fetch_model("s3://models2/nope.gguf", settings)
    with pytest.raises(ValueError):
        fetch_model("s3://just-a-bucket", settings)


def test_unreachable_endpoint_is_store_unavailable(redis_url: str, tmp_path: Path) -> None:
    from store.redis_server import free_port

    settings = s3_settings(f"http://127.0.0.1:{free_port()}", "models", redis_url, state_dir=tmp_path)
    with pytest.raises(StoreUnavailable):
        fetch_model("s3://models/x.gguf", settings)
    assert not os.path.exists(tmp_path / "models" / "s3" / "models" / "x.gguf")
