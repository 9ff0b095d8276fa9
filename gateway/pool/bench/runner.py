"""The plan of a run, its execution (interleaved, with progress), and the results document.

Each model gets one *run*: its workers are started, then every workload is played
request by request. For each request every system that applies answers it before the
next request starts, in an order rotated from one request to the next, so slow drift
(a neighbour's load, the page cache, thermal state) spreads over all systems alike.
The whole plan is laid out before anything runs: that is what the up-front duration
estimate and the progress lines count.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.pool.bench import measure
from gateway.pool.bench.inprocess import InProcessModel, LlamaCppSystem
from gateway.pool.bench.plan import (
    STATELESS,
    Echo,
    ModelRun,
    Planner,
    Prepared,
    Progress,
    Step,
    clock,
    floor_keep,
)
from gateway.pool.bench.services import Services, WorkerSpec
from gateway.pool.bench.systems import (
    KvpoolSystem,
    PoolClient,
    Sample,
    System,
    run_batch,
)
from gateway.pool.bench.workloads import (
    Request,
    TokenSource,
    build,
)
from gateway.pool.procs import WorkerProcess
from worker.cache.namespace import namespace_for
from worker.engine.kvcache import context_cache


def prepare(run: ModelRun, seed: int, max_foreign_load: float | None = None) -> Prepared:
    prof = run.profile
    model = InProcessModel(run.path, n_ctx=prof.n_ctx, threads=prof.threads)
    src = TokenSource(model.llm)
    workloads = build(prof.workloads, src, prof.sizes, seed)
    too_long = [r for w in workloads for r in w.requests if r.n + prof.max_tokens >= prof.n_ctx]
    if too_long:
        raise ValueError(f"{run.label}: a {too_long[0].n}-token prompt does not fit a {prof.n_ctx}-token context")
    if max_foreign_load is not None:
        measure.ForeignLoad().wait_below(max_foreign_load, timeout_s=60)
    cal = measure.calibrate(model.llm, src.pool, src.bos)
    prep = Prepared(run, model, src, workloads, cal)
    prep.steps = Planner(prep).plan()
    prep.startup_est_s = 3 * (8.0 + run.path.stat().st_size / 200e6)  # three rounds of worker start-ups
    return prep


class ModelSession:
    """One model's run: its workers (started as needed), its systems, and the plan's steps played in order."""

    def __init__(self, prep: Prepared, services: Services, progress: Progress, clock: float, max_foreign_load: float | None) -> None:
        self.prep = prep
        self.services = services
        self.progress = progress
        self.clock = clock
        self.max_foreign_load = max_foreign_load
        self.prof = prep.run.profile
        self.label = prep.run.label
        self.queue = f"bench:{self.label}"
        label, prof, q = self.label, self.prof, self.queue
        self.groups = {
            "single": [WorkerSpec(f"bench-{label}-single", prof.threads, f"{q}:single")],
            "cross": [WorkerSpec(f"bench-{label}-cross-{x}", prof.threads, f"{q}:cross") for x in "ab"],
            "pool": [WorkerSpec(f"bench-{label}-pool-{x}", prof.pool_threads, f"{q}:pool") for x in "12"],
            "nostore": [WorkerSpec(f"bench-{label}-nostore", prof.threads, f"{q}:nostore", store=False)],
        }
        self.running: dict[str, list[WorkerProcess]] = {}
        self.client = PoolClient(services.conn, prep.run.path, prof.chunk_size, prep.model.eos, [prep.src.bos, int(prep.src.pool[0])])
        mk: dict[str, Any] = {"model_label": label, "clock": clock}
        names = {g: [w.name for w in ws] for g, ws in self.groups.items()}
        scratch = services.work_dir
        self.systems: dict[str, System] = {
            "cold": LlamaCppSystem("cold", prep.model, "cold", scratch=scratch, **mk),
            "llama-ram": LlamaCppSystem("llama-ram", prep.model, "ram", scratch=scratch, **mk),
            "llama-disk": LlamaCppSystem("llama-disk", prep.model, "disk", scratch=scratch, **mk),
            "kvpool": KvpoolSystem("kvpool", self.client, names["single"], tenant="single", **mk),
            "kvpool-cross": KvpoolSystem("kvpool-cross", self.client, names["cross"], tenant="cross", cross=True, **mk),
            "kvpool-nostore": KvpoolSystem("kvpool-nostore", self.client, names["nostore"], tenant="nostore", store=False, **mk),
        }
        self.samples: list[Sample] = []
        self.batches: dict[str, object] = {}
        self.settings = services.store_settings()
        self.probe: measure.RawGetProbe | None = None
        self.foreign = measure.ForeignLoad()
        self.round_load: float | None = None
        self.loads: list[float] = []
        self.waited_s = 0.0

    def need(self, *names: str) -> None:
        """Start worker groups when first needed: each bench-model process holds its own ~2 GB copy of the weights."""
        todo = [n for n in names if n not in self.running]
        if not todo:
            return
        t = time.monotonic()
        specs = [w for n in todo for w in self.groups[n]]
        procs = self.services.start_workers(specs, model=self.prep.run.path, chunk_size=self.prof.chunk_size, n_ctx=self.prof.n_ctx)
        for n in todo:
            self.running[n] = [p for p in procs if p.name in {w.name for w in self.groups[n]}]
        self.progress.note(f"{self.label}: workers {', '.join(p.name for p in procs)} up in {time.monotonic() - t:.0f} s")

    def drop(self, name: str) -> None:
        if name in self.running:
            self.services.stop_workers(self.running.pop(name))

    def new_round(self) -> None:
        """Note (and with a limit, wait out) what other processes are using before the next request's systems run."""
        if self.max_foreign_load is None:
            load, waited = self.foreign.sample(), 0.0
        else:
            load, waited = self.foreign.wait_below(self.max_foreign_load)
        self.round_load = load
        if load is not None:
            self.loads.append(load)
        self.waited_s += waited
        if waited >= 1.0:
            self.progress.note(f"{self.label}: waited {waited:.0f} s for other processes to quiet down (now {load:.2f} cores)")

    def play(self) -> dict[str, object]:
        self.need("single", "cross")
        current: str | None = None
        last_request: Request | None = None
        try:
            for step in self.prep.steps:
                if step.workload != current:
                    self._switch(current, step.workload)
                    current = step.workload
                if step.request is not None and step.request is not last_request:
                    self.new_round()
                    last_request = step.request
                {"request": self._request, "probe": self._probe, "batch": self._batch}[step.kind](step)
            self._switch(current, None)
            return self._extras()
        finally:
            if self.probe is not None:
                self.probe.close()
            self.services.stop_workers([p for ps in self.running.values() for p in ps])
            self.running.clear()

    def _switch(self, old: str | None, new: str | None) -> None:
        for s in self.systems.values():
            if old is not None:
                s.end(old)
        if new == "unique":
            # The cost of a miss compares the single worker with a store-disabled one: start both afresh, so that
            # neither carries a different history (worker processes were seen to evaluate a few % apart).
            self.drop("single")
            self.need("single", "nostore")
        if new is not None:
            for s in self.systems.values():
                s.begin(new)

    def _request(self, step: Step) -> None:
        req = step.request
        assert req is not None
        sample, load = self._measure(step)
        if step.system in STATELESS and self.max_foreign_load is not None:
            # These leave nothing behind, so a request a neighbour disturbed can simply be asked again.
            for _ in range(2):
                if sample is None or load is None or load < self.max_foreign_load:
                    break
                self.progress.note(f"{self.label}: others used {load:.1f} cores during {step.system} {req.label}; asking again")
                self.new_round()
                again, again_load = self._measure(step)
                if again_load is not None and again_load < load:
                    sample, load = again, again_load
        head = f"{self.label}  {step.workload:<7} {step.system:<15} {req.label:<10}"
        if sample is None:
            self.progress.advance(step.est_s, f"{head} warm-up")
            return
        sample.foreign_cpu = load
        self.samples.append(sample)
        busy = f"  [others used {load:.1f} cores]" if load is not None and load >= 0.5 else ""
        self.progress.advance(
            step.est_s, f"{head} ttft {sample.ttft_s:7.3f} s  ({sample.reused_tokens} reused, {sample.evaluated_tokens} evaluated){busy}"
        )

    def _measure(self, step: Step) -> tuple[Sample | None, float | None]:
        """One answer to the step's request, and what other processes used meanwhile."""
        req = step.request
        assert req is not None
        mark = self.foreign.begin()
        if step.system == "suffix-only":
            keep = floor_keep(req, self.prof.chunk_size)
            secs = self.prep.model.suffix_eval(req.tokens, keep)
            sample: Sample | None = Sample(
                self.label,
                req.workload,
                "suffix-only",
                req.index,
                req.label,
                req.n,
                secs,
                secs,
                req.n - keep,
                keep,
                0,
                at_s=time.monotonic() - self.clock,
            )
        else:
            sample = self.systems[step.system].run(req, self.prof.max_tokens)
        return sample, self.foreign.end(mark)

    def _probe(self, step: Step) -> None:
        c = self.prof.chunk_size
        if self.probe is None:
            ns = namespace_for(self.client.settings, self.client.fingerprint, "cross:shared")
            sizes = measure.stored_bytes(self.client.index, ns)
            first = next(r for w in self.prep.workloads if w.key == "shared" for r in w.measured)
            obj = int(statistics.mean(sizes)) if sizes else context_cache(self.prep.model.llm).bytes_per_token * c
            self.probe = measure.RawGetProbe(self.settings, obj, max(1, floor_keep(first, c) // c), self.settings.io_threads)
        bw = self.probe.measure()
        self.progress.advance(
            step.est_s,
            f"{self.label}  shared  raw GET of {len(self.probe.names)} x {self.probe.object_bytes / 1e6:.1f} MB: {bw / 1e6:.0f} MB/s",
        )

    def _batch(self, step: Step) -> None:
        """All of a workload at once on the 2-worker pool.

        A neighbour's burst during the batch spoils its wall time; with a load limit set, the
        batch is run again (up to three times in all) under a fresh tenant -- which empties the
        workers' contexts and starts a fresh chain namespace, so each attempt starts alike -- and
        the quietest attempt is kept.
        """
        wl = next(w for w in self.prep.workloads if w.key == step.workload)
        self.need("pool")
        for w in self.groups["pool"]:
            self.client.flush(w.name)  # a fresh process's first job pays one-off allocations
        attempts: list[tuple[float, list[Sample], float]] = []
        for attempt in range(1, 4):
            self.new_round()
            mark = self.foreign.begin()
            batch, wall = run_batch(
                self.client,
                f"{self.queue}:pool",
                f"pool:docs:{attempt}",
                wl.requests,
                self.prof.max_tokens,
                system="kvpool-2w",
                model_label=self.label,
                clock=self.clock,
            )
            load = self.foreign.end(mark) or 0.0
            attempts.append((load, batch, wall))
            if self.max_foreign_load is None or load < self.max_foreign_load:
                break
            self.progress.note(f"{self.label}: others used {load:.1f} cores during the batch; running it again")
        self.drop("pool")
        load, batch, wall = min(attempts, key=lambda a: a[0])
        for s in batch:
            s.foreign_cpu = load
        self.samples += batch
        self.batches[step.workload] = {
            "workers": 2,
            "threads_each": self.prof.pool_threads,
            "requests": len(batch),
            "wall_s": wall,
            "attempts": [{"wall_s": w, "foreign_cpu": f} for f, _, w in attempts],
        }
        self.progress.advance(step.est_s, f"{self.label}  {step.workload:<7} kvpool-2w       {len(batch)} requests at once: {wall:.1f} s")

    def _extras(self) -> dict[str, object]:
        c, client, prep = self.prof.chunk_size, self.client, self.prep
        kv = context_cache(prep.model.llm)
        ns_shared = namespace_for(client.settings, client.fingerprint, "cross:shared")
        hashing = measure.hashing_and_lookup(self.services.conn, namespace_for(client.settings, client.fingerprint, "hash"))
        self.progress.note(f"{self.label}: hashing + lookup of 32k tokens {hashing['total_p50_s'] * 1e3:.2f} ms (p50)")  # type: ignore[operator]
        probe = self.probe
        stalls = {n: s.publish_stalls for n, s in self.systems.items() if isinstance(s, KvpoolSystem) and s.publish_stalls}
        during = [s.foreign_cpu for s in self.samples if s.foreign_cpu is not None]
        return {
            "model": {
                "label": self.label,
                "path": str(prep.run.path),
                "file_bytes": prep.run.path.stat().st_size,
                "fingerprint": client.fingerprint,
                "n_layer": kv.n_layer,
                "n_embd_k_gqa": kv.n_embd_k_gqa,
                "n_vocab": prep.model.llm.n_vocab(),
            },
            "profile": {**asdict(self.prof), "sizes": asdict(self.prof.sizes)},
            "calibration": prep.calibration,
            "workloads": [
                {
                    "key": w.key,
                    "title": w.title,
                    "description": w.description,
                    "requests": len(w.requests),
                    "measured": len(w.measured),
                    "prompt_tokens": [r.n for r in w.requests],
                }
                for w in prep.workloads
            ],
            "samples": [s.to_dict() for s in self.samples],
            "batches": self.batches,
            "publish_stalls": stalls,
            "foreign_load": {
                "limit_cores": self.max_foreign_load,
                "round_start_p50_cores": measure.pct(self.loads, 50),
                "during_p50_cores": measure.pct(during, 50),
                "during_p95_cores": measure.pct(during, 95),
                "samples_above_half_core": sum(1 for x in during if x >= 0.5),
                "samples": len(during),
                "waited_s": self.waited_s,
            },
            "bytes_per_token": measure.bytes_per_token(measure.stored_bytes(client.index, ns_shared), c, kv),
            "hashing": hashing,
            "raw_get": {
                "object_bytes": probe.object_bytes if probe else None,
                "objects": len(probe.names) if probe else 0,
                "threads": self.settings.io_threads,
                "bytes_per_s": probe.samples if probe else [],
            },
        }


def run_bench(
    models: list[ModelRun],
    *,
    out: Path,
    store: str,
    s3_endpoint_url: str | None,
    seed: int,
    command: str,
    echo: Echo,
    max_foreign_load: float | None = None,
) -> dict[str, object]:
    """Run every model's plan with services started here, write nothing; returns the results document."""
    started = datetime.now(UTC)
    t0 = time.monotonic()
    work_dir = Path(tempfile.mkdtemp(prefix="kvpool-bench-"))
    services = Services(work_dir, store, s3_endpoint_url)
    doc: dict[str, Any] = {
        "version": 1,
        "command": command,
        "started_at": started.isoformat(timespec="seconds"),
        "machine": measure.machine(),
        "store": store,
        "seed": seed,
        "max_foreign_load": max_foreign_load,
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
            preps.append(prepare(m, seed, max_foreign_load))
        est = sum(sum(s.est_s for s in p.steps) + p.startup_est_s for p in preps) + 10
        n_steps = sum(len(p.steps) for p in preps)
        for p in preps:
            cal = p.calibration
            echo(
                f"  {p.run.label}: {cal['prompt_tokens_per_s']:.0f} prompt tokens/s, {cal['decode_s_per_token'] * 1e3:.0f} ms per generated token "
                f"on {p.run.profile.threads} threads; {len(p.steps)} steps"
            )
        echo(f"Expected duration: about {clock(est)} (min:s, or h:min:s), {n_steps} steps. Ctrl-C stops everything cleanly.")
        progress = Progress(echo, n_steps, est)
        for p in preps:
            doc["runs"].append(ModelSession(p, services, progress, t0, max_foreign_load).play())
        ok = True
    finally:
        for p in preps:
            p.model.close()
        services.close(keep=not ok)
        if not ok:
            print(f"kvpool bench: stopped; services are down; logs kept in {work_dir}", file=sys.stderr)
    doc["duration_s"] = time.monotonic() - t0
    doc["machine"]["loadavg_at_end"] = list(os.getloadavg())
    return doc
