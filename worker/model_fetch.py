"""Models kept in the bucket: ``KVPOOL_MODEL=s3://bucket/models/x.gguf`` is downloaded once into a local cache.

A scaled pool then needs no shared volume. The cached copy is reused while the object's
ETag and size are unchanged; downloads go to a temp file renamed into place, so a worker
killed mid-download never leaves a truncated model behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from store.errors import StoreUnavailable
from store.s3 import s3_client
from store.settings import StoreSettings


def fetch_model(url: str, settings: StoreSettings) -> Path:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    if not bucket or not key:
        raise ValueError(f"a model URL looks like s3://bucket/path/model.gguf, got {url!r}")
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
    if dest.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == want and dest.stat().st_size == want["size"]:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".download-")
    os.close(fd)
    try:
        client.download_file(bucket, key, tmp)
        os.replace(tmp, dest)
    except (ClientError, BotoCoreError) as e:
        raise StoreUnavailable(f"{settings.s3_endpoint_url or 's3'}/{bucket}", f"download failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    stamp.write_text(json.dumps(want))
    return dest
