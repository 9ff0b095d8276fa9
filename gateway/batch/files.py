"""Files of the OpenAI Files API, kept in the store's bucket or folder, one folder per tenant.

A file is two blobs in the store's backend: its bytes under ``files/<tenant>/<id>`` and
its description (name, size, purpose, time) beside it as ``<id>.json``. ``<tenant>`` is
derived from the tenant's secret salt, so one tenant's files are out of every other
tenant's reach: a lookup under the wrong tenant is a plain 404. Uploads are for the
Batch API (purpose ``batch``) and must be JSONL; the Batch API writes its results as
files of purpose ``batch_output``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from gateway.errors import InvalidRequest, NotFound, map_exceptions
from gateway.tenants import Tenant
from store.backends import BlobBackend
from store.errors import BlobMissing

FILES_PREFIX = "files/"
UPLOAD_PURPOSES = ("batch",)


@dataclass(frozen=True)
class FileObject:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str

    def body(self) -> dict[str, Any]:
        return {**asdict(self), "object": "file", "status": "processed", "status_details": None}


def check_jsonl(data: bytes, max_lines: int) -> int:
    """The number of requests in a batch input file; `InvalidRequest` naming the first line that is not a JSON object."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the file is not UTF-8 text (byte {e.start})", param="file", code="invalid_file") from None
    n = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as e:
            raise InvalidRequest(
                f"line {number} is not JSON: {e.msg} (column {e.colno}); a batch file is JSONL", param="file", code="invalid_file"
            ) from None
        if not isinstance(doc, dict):
            raise InvalidRequest(f"line {number} is a JSON {type(doc).__name__}, not an object", param="file", code="invalid_file")
        n += 1
        if n > max_lines:
            raise InvalidRequest(
                f"the file has more than {max_lines} requests (KVPOOL_BATCH_MAX_REQUESTS)", param="file", code="batch_too_large"
            )
    if n == 0:
        raise InvalidRequest("the file holds no request", param="file", code="invalid_file")
    return n


class Files:
    """Opens the backend on first use, so a gateway starts (and answers everything else) while the store is away.

    A store that cannot be reached is the API's 503 (`gateway.errors.map_exceptions`), for
    the HTTP routes and the batch service alike.
    """

    def __init__(self, open_backend: Callable[[], BlobBackend]) -> None:
        self._open = open_backend
        self._backend: BlobBackend | None = None

    @property
    def backend(self) -> BlobBackend:
        if self._backend is None:
            with map_exceptions():
                self._backend = self._open()
        return self._backend

    @staticmethod
    def _name(tenant: Tenant, file_id: str) -> str:
        return f"{FILES_PREFIX}{tenant.salt[:24]}/{file_id}"

    def create(self, tenant: Tenant, filename: str, purpose: str, data: bytes) -> FileObject:
        meta = FileObject(f"file-{uuid.uuid4().hex[:24]}", len(data), int(time.time()), filename, purpose)
        name = self._name(tenant, meta.id)
        with map_exceptions():
            self.backend.put(name, data)
            self.backend.put(name + ".json", json.dumps(asdict(meta)).encode())
        return meta

    def get(self, tenant: Tenant, file_id: str) -> FileObject:
        if not file_id.startswith("file-") or "/" in file_id:
            raise NotFound(f"no file {file_id!r}", param="file_id", code="file_not_found")
        try:
            with map_exceptions():
                return FileObject(**json.loads(self.backend.get(self._name(tenant, file_id) + ".json")))
        except BlobMissing:
            raise NotFound(f"no file {file_id!r}", param="file_id", code="file_not_found") from None

    def content(self, tenant: Tenant, file_id: str) -> bytes:
        self.get(tenant, file_id)
        try:
            with map_exceptions():
                return self.backend.get(self._name(tenant, file_id))
        except BlobMissing:
            raise NotFound(f"the content of file {file_id!r} is gone", param="file_id", code="file_not_found") from None
