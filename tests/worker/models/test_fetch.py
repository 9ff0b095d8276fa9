"""Models in the bucket are fetched once into the local cache, refreshed when the object changes, and checked against a sha256 when given one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from gateway.pool.s3server import S3Server
from store.errors import StoreUnavailable
from tests.helpers import s3_settings
from worker.models.fetch import ModelChecksumError, fetch_model, resolve_model
from worker.models.packaged import SMOLLM2, sha256_of
from worker.settings import PoolSettings

KVPOOL = str(Path(sys.executable).parent / "kvpool")


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
    from gateway.pool.procs import free_port

    settings = s3_settings(f"http://127.0.0.1:{free_port()}", "models", redis_url, state_dir=tmp_path)
    with pytest.raises(StoreUnavailable):
        fetch_model("s3://models/x.gguf", settings)
    assert not os.path.exists(tmp_path / "models" / "s3" / "models" / "x.gguf")


def test_a_download_that_does_not_match_its_sha256_is_refused_and_not_kept(
    s3_server: S3Server, redis_url: str, tmp_path: Path, tiny_model: Path
) -> None:
    settings = s3_settings(s3_server.endpoint_url, "models3", redis_url, state_dir=tmp_path)
    client = s3(settings)
    client.create_bucket(Bucket="models3")
    client.upload_file(str(tiny_model), "models3", "m/tiny.gguf")
    right = sha256_of(tiny_model)

    with pytest.raises(ModelChecksumError, match=f"expected {'0' * 64}"):
        fetch_model("s3://models3/m/tiny.gguf", settings, sha256="0" * 64)
    folder = tmp_path / "models" / "s3" / "models3" / "m"
    assert not (folder / "tiny.gguf").exists() and not [p for p in folder.iterdir() if p.name.startswith(".download-")]

    local = fetch_model("s3://models3/m/tiny.gguf", settings, sha256=right.upper())
    assert sha256_of(local) == right
    stamp = local.stat().st_mtime_ns
    assert fetch_model("s3://models3/m/tiny.gguf", settings, sha256=right).stat().st_mtime_ns == stamp, "verified once, not again"

    client.put_object(Bucket="models3", Key="m/tiny.gguf", Body=b"GGUF-replaced")
    with pytest.raises(ModelChecksumError):
        fetch_model("s3://models3/m/tiny.gguf", settings, sha256=right)
    with pytest.raises(ValueError, match="64 hex digits"):
        fetch_model("s3://models3/m/tiny.gguf", settings, sha256="not-a-digest")


def test_kvpool_model_fetch_url_is_what_an_init_container_runs(
    s3_server: S3Server, redis_url: str, tmp_path: Path, tiny_model: Path
) -> None:
    """`kvpool model fetch --url ... --sha256 ...` puts the model where a worker with KVPOOL_MODEL=<url> looks, or fails loudly."""
    settings = s3_settings(s3_server.endpoint_url, "models4", redis_url, state_dir=tmp_path)
    s3(settings).create_bucket(Bucket="models4")
    s3(settings).upload_file(str(tiny_model), "models4", "tiny.gguf")
    env = {
        **os.environ,
        "KVPOOL_STATE_DIR": str(tmp_path),
        "KVPOOL_S3_ENDPOINT_URL": settings.s3_endpoint_url or "",
        "KVPOOL_S3_ACCESS_KEY_ID": settings.s3_access_key_id or "",
        "KVPOOL_S3_SECRET_ACCESS_KEY": settings.s3_secret_access_key or "",
    }
    fetch = [KVPOOL, "model", "fetch", "--url", "s3://models4/tiny.gguf", "--sha256"]

    wrong = subprocess.run([*fetch, "f" * 64], env=env, capture_output=True, text=True, timeout=60)
    assert wrong.returncode != 0 and f"expected {'f' * 64}" in wrong.stderr
    empty = subprocess.run([*fetch, ""], env=env, capture_output=True, text=True, timeout=60)
    assert empty.returncode != 0 and "64 hex digits" in empty.stderr, "an unset checksum variable must not pass as no checksum"

    done = subprocess.run([*fetch, sha256_of(tiny_model)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    local = tmp_path / "models" / "s3" / "models4" / "tiny.gguf"
    assert done.stdout.startswith(str(local)) and "verified" in done.stdout
    assert local.read_bytes() == tiny_model.read_bytes()


def test_the_default_model_comes_through_the_cache_kvpool_model_cache_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    with open(cache / SMOLLM2.filename, "wb") as f:  # stands in for an earlier download (the size is what the cache checks)
        f.truncate(SMOLLM2.size)
    monkeypatch.setenv("KVPOOL_MODEL_CACHE", str(cache))
    got = resolve_model(PoolSettings(state_dir=tmp_path / "state"))
    assert got == tmp_path / "state" / "models" / SMOLLM2.filename
    with open(got, "rb") as f:
        assert f.read(4) == bytes(4), "not the file in KVPOOL_MODEL_CACHE"
