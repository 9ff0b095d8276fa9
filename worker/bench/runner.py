"""The plan of a run, its execution (interleaved, with progress), and the results document.

Each model gets one *run*: its workers are started, then every workload is played
request by request. For each request every system that applies answers it before the
next request starts, in an order rotated from one request to the next, so slow drift
(a neighbour's load, the page cache, thermal state) spreads over all systems alike.
The whole plan is laid out before anything runs: that is what the up-front duration
estimate and the progress lines count.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from worker.bench import measure
from worker.bench.services import Services, WorkerSpec
from worker.bench.systems import (
    InProcessModel,
    KvpoolSystem,
    LlamaCppSystem,
    PoolClient,
    Sample,
    System,
    run_batch,
)
from worker.bench.workloads import WORKLOAD_KEYS, Request, Sizes, TokenSource, Workload, build
from worker.llama_state import kv_layout
from worker.namespace import namespace_for

Echo = Callable[[str], None]

SYSTEMS = ("cold", "llama-ram", "llama-disk", "kvpool", "kvpool-cross", "kvpool-2w", "kvpool-nostore", "suffix-only")
"""Every system name a sample can carry; ``suffix-only`` is the floor's evaluation part, not a system."""

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
    "bench": Profile("bench", Sizes(shared_questions=4, docs=2, doc_questions=4, unique_prompts=3), max_tokens=8, cold_repeats=3),
    "tiny": Profile("tiny", Sizes(), max_tokens=16),
    "quick": Profile(
        "quick",
        Sizes(
            prefix_tokens=128, question_tokens=16, shared_questions=2, chat_turns=3, chat_system_tokens=32,
            chat_user_tokens=24, chat_reply_tokens=16, docs=2, doc_tokens=96, doc_questions=2, unique_prompts=2, unique_tokens=64,
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
    return {measured[int(math.floor(i + 0.5))] for i in np.linspace(0, len(measured) - 1, cap)}


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

    def units(self, wl: Workload) -> list[list[str]]:
        units = [["cold"], ["llama-disk"], ["kvpool"], ["kvpool-cross"], ["llama-ram"] + (["suffix-only"] if wl.key == "shared" else [])]
        if wl.key == "unique":
            units.append(["kvpool-nostore"])
        return units

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
                units = self.units(wl)
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


def prepare(run: ModelRun, seed: int) -> Prepared:
    prof = run.profile
    model = InProcessModel(run.path, n_ctx=prof.n_ctx, threads=prof.threads)
    src = TokenSource(model.llm)
    workloads = build(prof.workloads, src, prof.sizes, seed)
    too_long = [r for w in workloads for r in w.requests if r.n + prof.max_tokens >= prof.n_ctx]
    if too_long:
        raise ValueError(f"{run.label}: a {too_long[0].n}-token prompt does not fit a {prof.n_ctx}-token context")
    cal = measure.calibrate(model.llm, src.pool, src.bos)
    prep = Prepared(run, model, src, workloads, cal)
    prep.steps = Planner(prep).plan()
    prep.startup_est_s = 3 * (8.0 + run.path.stat().st_size / 200e6)  # three rounds of worker start-ups
    return prep


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
        left = self.left_est * min(max(scale, 0.3), 3.0)
        self.echo(f"[{self.done:>3}/{self.total}] {_clock(self.elapsed())} (~{_clock(left)} left)  {line}")

    def note(self, line: str) -> None:
        self.echo(f"          {_clock(self.elapsed())}  {line}")


def _clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def run_model(prep: Prepared, services: Services, progress: Progress, clock: float) -> dict[str, object]:
    """Start this model's workers, play the plan, measure the extras; returns the run's part of the results."""
    run, prof = prep.run, prep.run.profile
    label, c = run.label, prof.chunk_size
    q = f"bench:{label}"
    groups = {
        "single": [WorkerSpec(f"bench-{label}-single", prof.threads, f"{q}:single")],
        "cross": [WorkerSpec(f"bench-{label}-cross-{x}", prof.threads, f"{q}:cross") for x in "ab"],
        "pool": [WorkerSpec(f"bench-{label}-pool-{x}", prof.pool_threads, f"{q}:pool") for x in "12"],
        "nostore": [WorkerSpec(f"bench-{label}-nostore", prof.threads, f"{q}:nostore", store=False)],
    }
    running: dict[str, list] = {}

    def need(*names: str) -> None:
        """Start worker groups when first needed: each bench-model process holds its own ~2 GB copy of the weights."""
        todo = [n for n in names if n not in running]
        if not todo:
            return
        t = time.monotonic()
        procs = services.start_workers([w for n in todo for w in groups[n]], model=run.path, chunk_size=c, n_ctx=prof.n_ctx)
        for n in todo:
            running[n] = [p for p in procs if p.name in {w.name for w in groups[n]}]
        progress.note(f"{label}: workers {', '.join(p.name for p in procs)} up in {time.monotonic() - t:.0f} s")

    def drop(name: str) -> None:
        if name in running:
            services.stop_workers(running.pop(name))

    need("single", "cross")
    client = PoolClient(services.conn, run.path, c, prep.model.eos, [prep.src.bos, int(prep.src.pool[0])])
    scratch = services.work_dir
    mk = dict(model_label=label, clock=clock)
    systems: dict[str, System] = {
        "cold": LlamaCppSystem("cold", prep.model, "cold", scratch=scratch, **mk),
        "llama-ram": LlamaCppSystem("llama-ram", prep.model, "ram", scratch=scratch, **mk),
        "llama-disk": LlamaCppSystem("llama-disk", prep.model, "disk", scratch=scratch, **mk),
        "kvpool": KvpoolSystem("kvpool", client, [w.name for w in groups["single"]], tenant="single", **mk),
        "kvpool-cross": KvpoolSystem("kvpool-cross", client, [w.name for w in groups["cross"]], tenant="cross", cross=True, **mk),
        "kvpool-nostore": KvpoolSystem("kvpool-nostore", client, [w.name for w in groups["nostore"]], tenant="nostore", store=False, **mk),
    }
    samples: list[Sample] = []
    batches: dict[str, object] = {}
    probe: measure.RawGetProbe | None = None
    settings = services.store_settings(c)
    current = None
    try:
        for step in prep.steps:
            if step.workload != current:
                if current is not None:
                    for s in systems.values():
                        s.end(current)
                current = step.workload
                if current == "unique":
                    need("nostore")
                for s in systems.values():
                    s.begin(current)
            wl_title = step.workload
            if step.kind == "request":
                req = step.request
                assert req is not None
                if step.system == "suffix-only":
                    keep = floor_keep(req, c)
                    secs = prep.model.suffix_eval(req.tokens, keep)
                    sample = Sample(label, req.workload, "suffix-only", req.index, req.label, req.n, secs, secs, req.n - keep, keep, 0,
                                    at_s=time.monotonic() - clock)
                else:
                    sample = systems[step.system].run(req, prof.max_tokens)
                if sample is None:
                    line = f"{label}  {wl_title:<7} {step.system:<15} {req.label:<10} warm-up"
                else:
                    samples.append(sample)
                    line = (f"{label}  {wl_title:<7} {step.system:<15} {req.label:<10} ttft {sample.ttft_s:7.3f} s  "
                            f"({sample.reused_tokens} reused, {sample.evaluated_tokens} evaluated)")
                progress.advance(step.est_s, line)
            elif step.kind == "probe":
                if probe is None:
                    ns = namespace_for(client.settings, client.fingerprint, "cross:shared")
                    sizes = measure.stored_bytes(client.index, ns)
                    first = next(r for w in prep.workloads if w.key == "shared" for r in w.measured)
                    n_obj = max(1, floor_keep(first, c) // c)
                    obj = int(statistics.mean(sizes)) if sizes else int(kv_layout(prep.model.llm).bytes_per_token * c)
                    probe = measure.RawGetProbe(settings, obj, n_obj, settings.io_threads)
                bw = probe.measure()
                progress.advance(step.est_s, f"{label}  shared  raw GET of {len(probe.names)} x {probe.object_bytes / 1e6:.1f} MB: {bw / 1e6:.0f} MB/s")
            elif step.kind == "batch":
                wl = next(w for w in prep.workloads if w.key == step.workload)
                need("pool")
                for w in groups["pool"]:
                    client.flush(w.name)  # a fresh process's first job pays one-off allocations
                batch, wall = run_batch(client, f"{q}:pool", "pool:docs", wl.requests, prof.max_tokens, system="kvpool-2w", **mk)
                drop("pool")
                samples += batch
                batches[step.workload] = {"workers": 2, "threads_each": prof.pool_threads, "requests": len(batch), "wall_s": wall}
                progress.advance(step.est_s, f"{label}  {wl_title:<7} kvpool-2w       {len(batch)} requests at once: {wall:.1f} s")
        if current is not None:
            for s in systems.values():
                s.end(current)

        extras: dict[str, object] = {}
        ns_shared = namespace_for(client.settings, client.fingerprint, "cross:shared")
        kv = kv_layout(prep.model.llm)
        extras["bytes_per_token"] = measure.bytes_per_token(measure.stored_bytes(client.index, ns_shared), c, kv)
        extras["hashing"] = measure.hashing_and_lookup(services.conn, namespace_for(client.settings, client.fingerprint, "hash"))
        progress.note(f"{label}: hashing + lookup of 32k tokens {extras['hashing']['total_p50_s'] * 1e3:.2f} ms (p50)")  # type: ignore[index]
        extras["raw_get"] = {
            "object_bytes": probe.object_bytes if probe else None,
            "objects": len(probe.names) if probe else 0,
            "threads": settings.io_threads,
            "bytes_per_s": probe.samples if probe else [],
        }
    finally:
        if probe is not None:
            probe.close()
        services.stop_workers()
    stalls = {n: s.publish_stalls for n, s in systems.items() if isinstance(s, KvpoolSystem) and s.publish_stalls}
    return {
        "model": {
            "label": label,
            "path": str(run.path),
            "file_bytes": run.path.stat().st_size,
            "fingerprint": client.fingerprint,
            "n_layer": kv.n_layer,
            "n_embd_k_gqa": kv.n_embd_k_gqa,
            "n_vocab": prep.model.llm.n_vocab(),
        },
        "profile": {**asdict(prof), "sizes": asdict(prof.sizes)},
        "calibration": prep.calibration,
        "workloads": [{"key": w.key, "title": w.title, "description": w.description, "requests": len(w.requests),
                       "measured": len(w.measured), "prompt_tokens": [r.n for r in w.requests]} for w in prep.workloads],
        "samples": [s.to_dict() for s in samples],
        "batches": batches,
        "publish_stalls": stalls,
        **extras,
    }


def run_bench(models: list[ModelRun], *, out: Path, store: str, s3_endpoint_url: str | None, seed: int, command: str, echo: Echo) -> dict[str, object]:
    """Run every model's plan with services started here, write nothing; returns the results document."""
    started = datetime.now(timezone.utc)
    t0 = time.monotonic()
    work_dir = Path(tempfile.mkdtemp(prefix="kvpool-bench-"))
    services = Services(work_dir, store, s3_endpoint_url)
    doc: dict[str, object] = {
        "version": 1,
        "command": command,
        "started_at": started.isoformat(timespec="seconds"),
        "machine": measure.machine(),
        "store": store,
        "seed": seed,
        "runs": [],
    }
    ok = False
    preps: list[Prepared] = []
    try:
        services.start()
        doc["store_endpoint"] = services.describe_store()
        echo(f"kvpool bench: {', '.join(m.label for m in models)}; store: {services.describe_store()}; results to {out}")
        for m in models:
            echo(f"  loading {m.label} ({m.path.stat().st_size / 1e9:.2f} GB) and timing it ...")
            preps.append(prepare(m, seed))
        est = sum(sum(s.est_s for s in p.steps) + p.startup_est_s for p in preps) + 10
        n_steps = sum(len(p.steps) for p in preps)
        for p in preps:
            cal = p.calibration
            echo(f"  {p.run.label}: {cal['prompt_tokens_per_s']:.0f} prompt tokens/s, {cal['decode_s_per_token'] * 1e3:.0f} ms per generated token "
                 f"on {p.run.profile.threads} threads; {len(p.steps)} steps")
        echo(f"Expected duration: about {_clock(est)} (min:s, or h:min:s), {n_steps} steps. Ctrl-C stops everything cleanly.")
        progress = Progress(echo, n_steps, est)
        for p in preps:
            doc["runs"].append(run_model(p, services, progress, t0))  # type: ignore[union-attr]
        ok = True
    finally:
        for p in preps:
            p.model.close()
        services.close(keep=not ok)
        if not ok:
            print(f"kvpool bench: stopped; services are down; logs kept in {work_dir}", file=sys.stderr)
    doc["duration_s"] = time.monotonic() - t0
    doc["machine"]["loadavg_at_end"] = list(os.getloadavg())  # type: ignore[index]
    return doc


def write_json(doc: dict[str, object], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=1, default=_jsonable) + "\n")


def _jsonable(x: object) -> object:
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, float) and math.isnan(x):
        return None
    raise TypeError(f"not JSON serializable: {type(x)}")

