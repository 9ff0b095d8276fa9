"""Restore or evaluate: moving estimates of how fast this worker restores from its store and evaluates, and the choice they make.

A restore moves state over the network: its cost grows with the bytes per token of the
model's KV and falls with the store's throughput, while evaluating costs the worker's own
compute. Neither wins everywhere (a slow link, a large KV per token and a fast CPU make
evaluating faster), so each sequence measures both (`RestoreRate` from its restores,
`worker.cache.leases.EvalRate` from its evaluations) and `choose` picks, among restoring
nothing, each whole chunk the store adds and the stored tail, the prefix whose restore
plus the evaluation of the rest is expected to take least. Either way the answer has the
cold run's bits: restored cells are those a cold evaluation makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from worker.cache.leases import EvalRate

MIN_BYTES = 4 * 1024 * 1024
"""Restores smaller than this are latency more than throughput: they are not measured, and not weighed (they are made)."""


class Choice(StrEnum):
    """The ``choice`` label of ``kvpool_worker_restore_choices_total``."""

    RESTORE = "restore"
    """Everything the store adds."""
    PARTIAL = "partial"
    """Some chunks, and the rest evaluated."""
    EVALUATE = "evaluate"
    """Nothing: evaluating is expected to be faster."""
    UNMEASURED = "unmeasured"
    """Everything, as nothing is measured yet to weigh it against."""
    SMALL = "small"
    """Everything, as it is under `MIN_BYTES`: mostly latency, which an estimate of throughput does not weigh."""


@dataclass
class RestoreRate:
    """Exponentially weighted throughput of this worker's restores: fetching, verifying and loading state."""

    weight: float = 0.3
    bytes_per_s: float | None = None
    bytes_per_token: float | None = None

    def observe(self, nbytes: int, tokens: int, seconds: float) -> None:
        """A restore of ``tokens`` tokens' state, ``nbytes`` bytes, that took ``seconds`` from the first request to loaded."""
        if nbytes < MIN_BYTES or tokens <= 0 or seconds <= 0:
            return
        w = self.weight
        rate, per_token = nbytes / seconds, nbytes / tokens
        self.bytes_per_s = rate if self.bytes_per_s is None else (1 - w) * self.bytes_per_s + w * rate
        self.bytes_per_token = per_token if self.bytes_per_token is None else (1 - w) * self.bytes_per_token + w * per_token

    def seconds_for(self, tokens: int) -> float | None:
        """Expected seconds to restore ``tokens`` tokens' state; None until measured."""
        if self.bytes_per_s is None or self.bytes_per_token is None:
            return None
        return tokens * self.bytes_per_token / self.bytes_per_s


@dataclass(frozen=True)
class Option:
    """Restore up to ``upto`` prompt tokens, fetching ``fetched`` tokens' worth of blobs."""

    upto: int
    fetched: int


@dataclass(frozen=True)
class Decision:
    choice: Choice
    upto: int
    """Prompt tokens held after the restore (the context's own when nothing is restored)."""
    restore_s: float | None
    """Expected seconds of the restore chosen, and of evaluating what it leaves."""
    evaluate_s: float | None
    cold_s: float | None
    """Expected seconds of evaluating everything past the context's own cells instead."""


def choose(options: list[Option], held: int, end: int, restores: RestoreRate, evals: EvalRate) -> Decision:
    """Among ``options`` (deepest last) and restoring nothing past ``held``, the fastest way to hold ``end`` tokens' cells."""
    deepest = options[-1]
    r_per_token = restores.seconds_for(1)
    if r_per_token is None or restores.bytes_per_token is None or evals.tokens_per_s is None:
        return Decision(Choice.UNMEASURED, deepest.upto, None, None, None)
    if deepest.fetched * restores.bytes_per_token < MIN_BYTES:
        return Decision(Choice.SMALL, deepest.upto, None, None, None)
    e_per_token = 1 / evals.tokens_per_s
    cold_s = (end - held) * e_per_token
    best, best_s = None, cold_s
    for opt in options:
        total = opt.fetched * r_per_token + (end - opt.upto) * e_per_token
        if total < best_s:
            best, best_s = opt, total
    if best is None:
        return Decision(Choice.EVALUATE, held, None, cold_s, cold_s)
    choice = Choice.RESTORE if best == deepest else Choice.PARTIAL
    return Decision(choice, best.upto, best.fetched * r_per_token, (end - best.upto) * e_per_token, cold_s)
