"""What a benchmark report records about where it ran: date, commit, CPU model and flags, llama-server's build.

`kvpool bench-peers` writes these facts into its report (``peers.json``'s ``provenance``);
a report made before it did has them in a ``meta.json`` beside it, filled from git's log
and what the report itself says (`gateway.pool.bench.glance` reads either). A fact not
known is ``None``, never a guess.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
from pathlib import Path
from typing import Any

FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
"""The CPU flags that choose llama.cpp's x86 kernels (and so the bits it computes), as /proc/cpuinfo names them."""


def _git(repo: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit(repo: Path) -> str | None:
    """The short commit the code ran at, with ``-dirty`` when the work tree had changes to tracked files."""
    head = _git(repo, "rev-parse", "--short", "HEAD")
    if head is None:
        return None
    dirty = _git(repo, "status", "--porcelain", "--untracked-files=no")
    return head + ("-dirty" if dirty else "")


def cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str | None, list[str]]:
    """The CPU's model name and which of `FLAGS` it has."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None, []
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    have = set(flags.group(1).split()) if flags else set()
    return (model.group(1).strip() if model else None), [f for f in FLAGS if f in have]


def llama_server_build(binary: Path | None) -> str | None:
    """``llama-server --version``'s build line (``version: 1 (abcdef0)``, the compiler), or None without a binary."""
    if binary is None:
        return None
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.startswith(("version", "built with"))]
    return "; ".join(lines) or None


def provenance(repo: Path, llama_server: Path | None, threads: int) -> dict[str, Any]:
    model, flags = cpu()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(repo),
        "cpu": model,
        "cpu_flags": flags,
        "threads": threads,
        "llama_server": llama_server_build(llama_server),
    }


def of_report(folder: Path) -> dict[str, Any] | None:
    """A report's facts: ``peers.json``'s own, else its ``meta.json``'s; None for a report that has neither."""
    doc = json.loads((folder / "peers.json").read_text())
    if isinstance(doc.get("provenance"), dict):
        return dict(doc["provenance"])
    meta = folder / "meta.json"
    return dict(json.loads(meta.read_text())) if meta.exists() else None
