"""The store's byte budget: ``KVPOOL_STORE_MAX_BYTES`` when set (``0``: none), else a default for the store's kind.

Every store is bounded unless told otherwise. A folder store (the embedded default)
shares its disk with everything else on the machine, so by default it keeps at most
`DISK_SHARE` of the room it has there at start-up (the disk's free space plus what the
store already holds), and never more than `DISK_CAP`. An S3 store cannot see its
server's disk: it keeps `S3_DEFAULT` by default, so that a bucket nobody bounded (the
compose stack's MinIO, say) does not grow without limit. Each process logs the budget it
uses and where it comes from (``store.budget``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass

from store.backends import BlobBackend
from store.backends.fs import FsBackend

DISK_SHARE = 0.2
"""Share of the room on its disk that a folder store takes by default."""
DISK_CAP = 32 * 2**30
"""The most a folder store keeps by default, however large its disk (32 GiB)."""
S3_DEFAULT = 32 * 2**30
"""What an S3 store keeps by default (32 GiB): a bucket is better bounded where it is provisioned, but never left unbounded."""


@dataclass(frozen=True)
class Budget:
    max_bytes: int | None
    """None: no budget."""
    source: str
    """Where the number comes from, for the start-up log."""


def store_budget(configured: int | None, backend: BlobBackend, stored: Callable[[], int]) -> Budget:
    """The budget for ``backend``: ``configured`` (``KVPOOL_STORE_MAX_BYTES``) if set (0: none), else the default for its kind.

    ``stored`` reads the bytes the store holds now (from the index), asked only for a folder store.
    """
    if configured == 0:
        return Budget(None, "KVPOOL_STORE_MAX_BYTES=0: none")
    if configured is not None:
        return Budget(configured, "KVPOOL_STORE_MAX_BYTES")
    if isinstance(backend, FsBackend):
        free, held = shutil.disk_usage(backend.root).free, stored()
        room = free + held
        size = min(DISK_CAP, int(DISK_SHARE * room))
        why = f"{DISK_SHARE:.0%} of {gib(room)} ({gib(free)} free on its disk + {gib(held)} stored)"
        why += f", capped at {gib(DISK_CAP)}" if size == DISK_CAP else ""
        return Budget(size, f"default for a folder store: {why}")
    return Budget(S3_DEFAULT, f"default for S3: {gib(S3_DEFAULT)} (set KVPOOL_STORE_MAX_BYTES to change it, 0 for none)")


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
