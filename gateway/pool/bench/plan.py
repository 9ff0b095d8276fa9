"""What a benchmark run plays: the systems, the size profiles, and the plan of steps laid out before anything runs.

For each request every system that applies answers it before the next request starts,
in an order rotated from one request to the next, so slow drift (a neighbour's load,
the page cache, thermal state) spreads over all systems alike; the up-front duration
estimate and the progress lines count these steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gateway.pool.bench.inprocess import InProcessModel
from gateway.pool.bench.workloads import WORKLOAD_KEYS, Request, Sizes, TokenSource, Workload

SYSTEMS = ("cold", "llama-ram", "llama-disk", "kvpool", "kvpool-cross", "kvpool-2w", "kvpool-nostore", "suffix-only")
"""Every system name a sample can carry; ``suffix-only`` is the floor's evaluation part, not a system."""

STATELESS = {"cold", "suffix-only"}
"""Systems whose answer leaves no state behind (no cache, context emptied first): safe to ask again."""

SYSTEM_TITLES = {
    "cold": "llama-cpp-python, no cache",
    "llama-ram": "llama-cpp-python + LlamaRAMCache",
    "llama-disk": "llama-cpp-python + LlamaDiskCache",
    "kvpool": "kvpool, 1 worker",
    "kvpool-cross": "kvpool, cross-worker (store only)",
    "kvpool-2w": "kvpool, 2 workers x 1 thread (batch)",
    "kvpool-nostore": "kvpool, store disabled",
    "suffix-only": "suffix evaluation only (floor part)",
}


@dataclass(frozen=True)
class Profile:
    """Workload sizes and settings for one model; ``cold_repeats`` caps the cold system's measured requests per workload."""

    name: str
    sizes: Sizes
    chunk_size: int = 256
    n_ctx: int = 4096
    threads: int = 2
    pool_threads: int = 1
    max_tokens: int = 8
    cold_repeats: int | None = None
    workloads: tuple[str, ...] = WORKLOAD_KEYS


PROFILES = {
    # Reduced so the bench model fits ~20 minutes on 2 cores: a cold 2k-token prompt takes ~40 s there.
    "bench": Profile("bench", Sizes(shared_questions=4, docs=2, doc_questions=4, unique_prompts=6), max_tokens=8, cold_repeats=3),
    "tiny": Profile("tiny", Sizes(), max_tokens=16),
    "quick": Profile(
        "quick",
        Sizes(
            prefix_tokens=128,
            question_tokens=16,
            shared_questions=2,
            chat_turns=3,
            chat_system_tokens=32,
            chat_user_tokens=24,
            chat_reply_tokens=16,
            docs=2,
            doc_tokens=96,
            doc_questions=2,
            unique_prompts=2,
            unique_tokens=64,
        ),
        chunk_size=32,
        n_ctx=1024,
        threads=1,  # a smoke run shares its 2 cores with whatever else runs; one thread each waits less on a busy neighbour
        max_tokens=4,
    ),
    "custom": Profile("custom", Sizes(), max_tokens=8, cold_repeats=3),
}


@dataclass
class ModelRun:
    """One model and the profile it runs under."""

    label: str
    path: Path
    profile: Profile


@dataclass
class Step:
    kind: str  # request | batch | probe
    workload: str
    system: str = ""
    request: Request | None = None
    est_s: float = 0.0


@dataclass
class Prepared:
    run: ModelRun
    model: InProcessModel
    src: TokenSource
    workloads: list[Workload]
    calibration: dict[str, float]
    steps: list[Step] = field(default_factory=list)
    startup_est_s: float = 0.0


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def cold_subset(wl: Workload, cap: int | None) -> set[int]:
    """Indices of the measured requests the cold system answers: all, or ``cap`` spread evenly."""
    measured = [r.index for r in wl.measured]
    if cap is None or cap >= len(measured):
        return set(measured)
    return {measured[math.floor(i + 0.5)] for i in np.linspace(0, len(measured) - 1, cap)}


def floor_keep(req: Request, chunk_size: int) -> int:
    """The prefix a cross-worker hit restores for a shared-prefix request: its full chunks."""
    return min(req.shared, req.n - 1) // chunk_size * chunk_size


class Planner:
    """Lays out the steps of one model run and estimates each one's seconds."""

    def __init__(self, prep: Prepared) -> None:
        self.p = prep
        cal = prep.calibration
        self.rate = cal["prompt_tokens_per_s"]
        self.decode = cal["decode_s_per_token"]

    def eval_s(self, n: int, ctx: int) -> float:
        return n / self.rate * (1 + ctx / 4096)

    @staticmethod
    def units(wl: Workload, round_index: int) -> list[list[str]]:
        """Systems that run back to back: the suffix-only floor reuses the RAM cache's context, and on B4 the store-enabled
        and store-disabled workers form adjacent pairs (in alternating order) so that the cost of a miss is a paired difference."""
        kvpool = ["kvpool"]
        if wl.key == "unique":
            kvpool = ["kvpool", "kvpool-nostore"] if round_index % 2 == 0 else ["kvpool-nostore", "kvpool"]
        ram = ["llama-ram", "suffix-only"] if wl.key == "shared" else ["llama-ram"]
        return [["cold"], ["llama-disk"], kvpool, ["kvpool-cross"], ram]

    def plan(self) -> list[Step]:
        prof = self.p.run.profile
        c = prof.chunk_size
        steps: list[Step] = []
        for wl in self.p.workloads:
            cold = cold_subset(wl, prof.cold_repeats)
            seen: list[list[int]] = []
            for r_i, req in enumerate(wl.requests):
                best = max((_lcp(req.tokens, s) for s in seen), default=0)
                prev = _lcp(req.tokens, seen[-1]) if seen else 0
                reuse = {
                    "cold": 0,
                    "llama-ram": best,
                    "llama-disk": best,
                    "kvpool": max(prev, best // c * c),
                    "kvpool-cross": best // c * c,
                    "kvpool-nostore": prev,
                    "suffix-only": floor_keep(req, c),
                }
                units = self.units(wl, r_i)
                shift = r_i % len(units)
                for unit in units[shift:] + units[:shift]:
                    for system in unit:
                        if system == "cold" and (req.warmup or req.index not in cold):
                            continue
                        if system in ("suffix-only", "kvpool-nostore") and req.warmup:
                            continue
                        est = self.eval_s(req.n - min(reuse[system], req.n - 1), req.n) + prof.max_tokens * self.decode
                        est += {"kvpool-cross": 0.6, "kvpool": 0.3, "llama-disk": 0.5}.get(system, 0.1)
                        steps.append(Step("request", wl.key, system, req, est))
                if wl.key == "shared" and not req.warmup:
                    steps.append(Step("probe", wl.key, est_s=0.5))
                seen.append(req.tokens)
            if wl.key == "docs":
                est = sum(self.eval_s(r.n, r.n) for r in wl.requests) * 0.6
                steps.append(Step("batch", wl.key, "kvpool-2w", est_s=est))
        return steps


Echo = Callable[[str], None]


class Progress:
    """Prints one line per step with the elapsed time and what is left, rescaled by how the estimates have fared so far."""

    def __init__(self, echo: Echo, total_steps: int, total_est_s: float) -> None:
        self.echo = echo
        self.total = total_steps
        self.left_est = total_est_s
        self.done = 0
        self.spent_est = 0.0
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def advance(self, est_s: float, line: str) -> None:
        self.done += 1
        self.spent_est += est_s
        self.left_est = max(0.0, self.left_est - est_s)
        scale = self.elapsed() / self.spent_est if self.spent_est > 0 else 1.0
        left = self.left_est * min(max(scale, 0.05), 20.0)
        self.echo(f"[{self.done:>3}/{self.total}] {clock(self.elapsed())} (~{clock(left)} left)  {line}")

    def note(self, line: str) -> None:
        self.echo(f"          {clock(self.elapsed())}  {line}")


def clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"
