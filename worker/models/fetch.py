"""Models kept in the bucket: ``KVPOOL_MODEL=s3://bucket/models/x.gguf`` is downloaded once into a local cache.

A scaled pool then needs no shared volume. The cached copy is reused while the object's
ETag and size are unchanged; downloads go to a temp file renamed into place, so a worker
killed mid-download never leaves a truncated model behind.

With a sha256 (``KVPOOL_MODEL_SHA256``, or ``kvpool model fetch --sha256``) a download
that does not match is refused and never put in place; the stamp beside the cached copy
records the digest it was verified against, so a copy fetched once (by an init
container, say) is not hashed again by every process that starts on it.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from store.backends.s3 import s3_client
from store.errors import StoreUnavailable
from store.settings import StoreSettings
from worker.errors import ModelChecksumError
from worker.models.packaged import sha256_of
from worker.settings import PoolSettings

SHA256 = re.compile(r"^[0-9a-f]{64}$")


def fetch_model(url: str, settings: StoreSettings, sha256: str | None = None) -> Path:
    """The local copy of ``url``, downloaded when missing or changed; checked against ``sha256`` when given."""
    bucket, _, key = url.removeprefix("s3://").partition("/")
    if not url.startswith("s3://") or not bucket or not key:
        raise ValueError(f"a model URL looks like s3://bucket/path/model.gguf, got {url!r}")
    if sha256 is not None:
        sha256 = sha256.lower()
        if not SHA256.match(sha256):
            raise ValueError(f"a sha256 is 64 hex digits, got {sha256!r}")
    dest = settings.state_dir / "models" / "s3" / bucket / key
    stamp = dest.with_name(dest.name + ".kvpool-etag")
    client = s3_client(settings)
    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code")
        if code in ("404", "NoSuchKey", "NotFound"):
            raise FileNotFoundError(f"model not found: {url}") from None
        raise StoreUnavailable(f"{settings.s3_endpoint_url or 's3'}/{bucket}", f"{code}: {e}") from None
    except BotoCoreError as e:
        raise StoreUnavailable(f"{settings.s3_endpoint_url or 's3'}/{bucket}", str(e)) from None
    want = {"etag": head["ETag"], "size": head["ContentLength"]}
    if _cached(dest, stamp, want, sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".download-")
    os.close(fd)
    try:
        client.download_file(bucket, key, tmp)
        if sha256 is not None and (got := sha256_of(Path(tmp))) != sha256:
            raise ModelChecksumError(f"{url} has sha256 {got}, expected {sha256}; the download was discarded")
        os.replace(tmp, dest)
    except (ClientError, BotoCoreError) as e:
        raise StoreUnavailable(f"{settings.s3_endpoint_url or 's3'}/{bucket}", f"download failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    stamp.write_text(json.dumps({**want, "sha256": sha256} if sha256 else want))
    return dest


def _cached(dest: Path, stamp: Path, want: dict[str, object], sha256: str | None) -> bool:
    """Whether the local copy is the object as it is now (same ETag and size), verified against ``sha256`` if one is asked for."""
    if not (dest.is_file() and stamp.is_file()):
        return False
    try:
        have = json.loads(stamp.read_text())
    except ValueError:
        return False
    same = have.get("etag") == want["etag"] and have.get("size") == want["size"] == dest.stat().st_size
    return same and (sha256 is None or have.get("sha256") == sha256)


def resolve_model(settings: PoolSettings) -> Path:
    """The model file to load: a path, an ``s3://`` URL (downloaded once), or the packaged SmolLM2 by default."""
    if not settings.model:
        from worker.models.packaged import DEFAULT_MODEL, ensure_packaged

        return ensure_packaged(DEFAULT_MODEL, settings.state_dir / "models", settings.model_cache)
    if settings.model.startswith("s3://"):
        return fetch_model(settings.model, settings, sha256=settings.model_sha256 or None)
    path = Path(settings.model)
    if not path.is_file():
        raise FileNotFoundError(f"model not found: {path}")
    return path
