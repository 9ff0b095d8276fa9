"""A blob backend on a local directory: the embedded default."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from store.backends.base import ObjectInfo
from store.errors import BlobMissing, StoreUnavailable


class FsBackend:
    """Blobs as files under ``root``; writes go to a temp file renamed into place, so readers never see half a blob."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self.endpoint = f"file://{self.root}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(self.endpoint, str(e)) from e

    def _path(self, name: str) -> Path:
        path = (self.root / name).absolute()
        if self.root not in path.parents:
            raise ValueError(f"blob name escapes the store root: {name!r}")
        return path

    def get(self, name: str) -> bytes:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            raise BlobMissing(name) from None
        except OSError as e:
            raise StoreUnavailable(self.endpoint, str(e)) from e

    def put(self, name: str, data: bytes) -> None:
        path = self._path(name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            raise StoreUnavailable(self.endpoint, str(e)) from e

    def exists(self, name: str) -> bool:
        try:
            return self._path(name).is_file()
        except OSError as e:
            raise StoreUnavailable(self.endpoint, str(e)) from e

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink(missing_ok=True)
        except OSError as e:
            raise StoreUnavailable(self.endpoint, str(e)) from e

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for dirpath, _dirs, files in os.walk(self.root):
            for fname in sorted(files):
                if fname.startswith(".tmp-"):
                    continue
                full = Path(dirpath) / fname
                name = full.relative_to(self.root).as_posix()
                if name.startswith(prefix):
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue
                    yield ObjectInfo(name, st.st_size, st.st_mtime)
