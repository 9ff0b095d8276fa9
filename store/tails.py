"""Resuming at the exact token: which stored tail serves a prompt, and how far.

A tail is the partial last chunk of a prompt some worker evaluated (`store.chain.tail_key`).
It hangs from a full chunk, so a lookup that finds the prompt's deepest stored chunk
also gets every tail hanging from it (`store.index.RedisIndex.lookup`). The last full
chunk of each published prompt is offered the same way (`RedisIndex.add_branch`): that
is where a document's next question, say, parts from the one asked before, and its
first cells serve it up to that point. A cell depends
only on the tokens up to its own position, so the first ``j`` cells of a tail are exactly
what a cold evaluation of the prompt would hold wherever the prompt's tokens after that
chunk start with the tail's first ``j`` tokens. The best tail is the one that agrees
longest; a tail is used only up to that point, never past it.

The match comes from the index's copy of each tail's tokens. The blob is then verified
against those tokens, its parent and its key (`store.blob.verify_blob`) like any chunk,
before a cell of it is used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TailMatch:
    key: bytes
    tokens: np.ndarray
    """All of the stored tail's tokens."""
    usable: int
    """Its leading cells that serve the prompt: the tokens it shares with the prompt's rest."""
    full: bool = False
    """A full chunk offered as a candidate, not a tail: stored and verified as a chunk."""


@dataclass(frozen=True)
class Hit:
    """How much of a prompt the store holds: full chunks, then part or all of one tail."""

    depth: int
    chunk_size: int
    tail: TailMatch | None = None

    @property
    def tokens(self) -> int:
        return self.depth * self.chunk_size + (self.tail.usable if self.tail else 0)


def common_prefix(a: np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def best_tail(tails: Mapping[bytes, np.ndarray], rest: Sequence[int] | np.ndarray, chunk_size: int = 0) -> TailMatch | None:
    """The tail that agrees longest with ``rest`` (the prompt after the deepest stored chunk), if any agrees at all.

    Ties go to the shorter tail: fewer bytes to fetch for the same cells.
    """
    best: TailMatch | None = None
    for key, toks in tails.items():
        n = common_prefix(toks, rest)
        if n and (best is None or n > best.usable or (n == best.usable and len(toks) < len(best.tokens))):
            best = TailMatch(key, toks, n, full=len(toks) == chunk_size)
    return best
