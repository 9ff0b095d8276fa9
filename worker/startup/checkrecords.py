"""Start-up checks remembered on the worker's disk, so a fleet of identical workers runs them once.

A worker proves two things about its model and build before it serves (`worker.startup.loaded`):
that a restore gives a cold evaluation's logits (`worker.startup.selfcheck`) and which decode mode
keeps the cold bits (`worker.engine.decoding.choose_mode`). Both outcomes depend only on what
this module puts in a check's *identity*: the model file's digest, every shared library
of the loaded llama.cpp (its bytes, so a rebuilt or re-patched library counts as new),
the kernel fingerprint, the CPU's model name, the KV layout, the context's shape and
`CHECKS_VERSION`. A record is one JSON file per check and identity, written whole
(a temporary file renamed over it), in ``KVPOOL_CHECK_RECORDS``; a worker whose identity
matches a record takes its outcome instead of running the check, and its log line says
so (``"source": "record"``). Anything unreadable or of another identity is ignored and
the check runs again.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from store.fingerprint import fingerprint_file

log = logging.getLogger("kvpool.worker")

CHECKS_VERSION = 1
"""Bumped whenever a start-up check changes what it runs or how it decides: every record then goes stale."""


Outcome = TypeVar("Outcome")
"""A check's outcome: a frozen dataclass of plain fields (`worker.startup.selfcheck.SelfCheck`, `worker.engine.decoding.ModeChoice`)."""


def default_folder() -> Path:
    """The per-user cache folder of the XDG convention: ``$XDG_CACHE_HOME/kvpool/checks``, else ``~/.cache/kvpool/checks``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvpool" / "checks"


def library_folder() -> Path:
    """Where the llama.cpp this process loaded keeps its shared libraries (llama-cpp-python's ``lib/``)."""
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


@cache
def library_digest(folder: Path) -> str:
    """One digest of every shared library in ``folder`` (llama, ggml and its backends): a rebuilt one is another digest."""
    libs = sorted(p for p in folder.glob("*.so*") if p.is_file() and not p.name.endswith(".kvpool-fingerprint"))
    return xxhash.xxh3_64_hexdigest("\n".join(f"{p.name}={fingerprint_file(p)}" for p in libs).encode())


@cache
def cpu_model() -> str:
    """The CPU's model name, as the kernel reports it (a build's runtime dispatch may pick kernels by it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown"


@dataclass(frozen=True)
class CheckRecords:
    """Where a worker keeps its start-up checks' outcomes, and the identity they hold for (None: never remembered)."""

    folder: Path | None
    identity: Mapping[str, str]

    @classmethod
    def for_worker(cls, folder: Path | None, *, library: Path | None = None, **facts: object) -> CheckRecords:
        """``facts`` (model, layout, context shape, ...) plus the llama.cpp ``library`` (default: the one loaded), the CPU
        and `CHECKS_VERSION`."""
        ident = {k: str(v) for k, v in facts.items()}
        ident |= {"library": library_digest(library or library_folder()), "cpu": cpu_model(), "checks": str(CHECKS_VERSION)}
        return cls(folder, dict(sorted(ident.items())))

    def path(self, check: str) -> Path | None:
        if self.folder is None:
            return None
        digest = xxhash.xxh3_64_hexdigest(json.dumps(self.identity, sort_keys=True).encode())
        return self.folder / f"{check}-{digest}.json"

    def recall(self, check: str, kind: type[Outcome], run: Callable[[], Outcome]) -> tuple[Outcome, str]:
        """The outcome of ``check``: from its record when one holds for this identity, else from ``run()``, then recorded.

        Returns it and where it came from: ``"record"`` or ``"checked"``.
        """
        path = self.path(check)
        if path is not None:
            try:
                data = json.loads(path.read_text())
                if data["identity"] == self.identity:
                    return kind(**data["outcome"]), "record"
            except (OSError, ValueError, KeyError, TypeError):
                pass  # none, unreadable, or another shape: check again
        outcome = run()
        if path is not None:
            self._write(path, {"identity": self.identity, "outcome": vars(outcome), "checked_at": time.time()})
        return outcome, "checked"

    @staticmethod
    def _write(path: Path, data: dict[str, Any]) -> None:
        """Whole or not at all: a reader never sees half a record (several workers may start at once)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except OSError as e:  # a read-only disk costs the next worker the check, nothing else
            log.warning("checks.unrecorded", extra={"path": str(path), "error": str(e)})
