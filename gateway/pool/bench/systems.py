"""The systems compared, each answering one `Request` and reporting a `Sample`.

* ``cold``: llama-cpp-python evaluating every prompt in full (the context is emptied first).
* ``llama-ram`` / ``llama-disk``: llama-cpp-python with `LlamaRAMCache` / `LlamaDiskCache`
  through ``create_completion``, one process, a fresh cache per workload. The context
  is emptied before each request so that a hit is the cache's doing (a server
  interleaving other prompts loses its context too); this is their best case: the
  cache lives in the process that asks.
* ``kvpool``: one worker, its own context first, then the store.
* ``kvpool-cross``: two workers; warm-ups go to the first, measured requests alternate
  between them, and before each one the serving worker answers a one-token job under
  another tenant, which empties its context. Every reused token therefore has to come
  from the store, and each sample records ``cached_from_context`` so the report can
  prove it.
* ``kvpool-nostore``: one worker whose store is disabled, for the cost of a miss.

The three llama-cpp-python systems share one in-process model (same weights in
memory, same threads). Time to first token is taken when the first token has been
sampled: by a stopping-criteria hook in process, and for kvpool when the client reads
the first token event from the job's stream (so it includes the queue).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import redis

from gateway.pool.bench.workloads import Request
from store.chain import BlobKey
from store.fingerprint import fingerprint_file
from store.index import RedisIndex
from worker.cache.namespace import namespace_for
from worker.client import events, submit
from worker.protocol import (
    DoneEvent,
    ErrorEvent,
    JobResult,
    JobSpec,
    SamplingParams,
    TokenEvent,
    job_spec,
    worker_queue,
)
from worker.settings import WorkerSettings

SAMPLING = {"temperature": 0.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}
"""Greedy decoding, the same for every system; EOS is banned so every request generates ``max_tokens``."""

FLUSH_TENANT = "bench-flush"


@dataclass
class Sample:
    model: str
    workload: str
    system: str
    request: int
    label: str
    prompt_tokens: int
    ttft_s: float
    total_s: float
    evaluated_tokens: int
    reused_tokens: int
    completion_tokens: int
    cached_from_context: int = 0
    cached_from_store: int = 0
    worker: str | None = None
    worker_ttft_s: float | None = None
    lookup_s: float | None = None
    fetch_s: float | None = None
    restore_s: float | None = None
    prompt_eval_s: float | None = None
    at_s: float = 0.0
    loadavg_1m: float = 0.0
    foreign_cpu: float | None = None
    """Cores' worth of CPU other processes used while this request ran (whole batch, for a batch)."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class System(Protocol):
    name: str

    def begin(self, workload: str) -> None: ...

    def run(self, req: Request, max_tokens: int) -> Sample | None: ...

    def end(self, workload: str) -> None: ...


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


class PoolClient:
    """Builds jobs as the gateway does (tokens, chain keys, tenant) and reads their streams."""

    def __init__(self, conn: redis.Redis[bytes], model_path: Path, chunk_size: int, eos: int, flush_tokens: list[int]) -> None:
        self.conn = conn
        self.chunk_size = chunk_size
        self.settings = WorkerSettings(chunk_size=chunk_size)
        self.fingerprint = fingerprint_file(model_path)
        self.eos = eos
        self.flush_tokens = flush_tokens
        self.index = RedisIndex(conn)

    def keys(self, tokens: list[int], tenant: str) -> list[BlobKey]:
        return namespace_for(self.settings, self.fingerprint, tenant).chain(tokens)

    def spec(self, tokens: list[int], tenant: str, max_tokens: int) -> JobSpec:
        return job_spec(
            tokens,
            model=self.fingerprint,
            chunk_size=self.chunk_size,
            tenant_salt=tenant,
            sampling=SamplingParams(
                max_tokens=max_tokens,
                temperature=SAMPLING["temperature"],
                top_k=int(SAMPLING["top_k"]),
                top_p=SAMPLING["top_p"],
                min_p=SAMPLING["min_p"],
                repeat_penalty=SAMPLING["repeat_penalty"],
                logit_bias={self.eos: -100.0},
            ),
            enqueued_at=time.time(),
        )

    def collect(self, job_id: str, t0: float, timeout_s: float = 900.0) -> tuple[JobResult, float, float]:
        """The job's result, and the seconds from ``t0`` to its first token and to its end, as the client saw them."""
        first = None
        for ev in events(self.conn, job_id, timeout_s=timeout_s):
            if isinstance(ev, TokenEvent) and first is None:
                first = time.perf_counter()
            elif isinstance(ev, DoneEvent):
                done = time.perf_counter()
                return ev.result, (first or done) - t0, done - t0
            elif isinstance(ev, ErrorEvent) and not ev.retrying:
                raise RuntimeError(f"job {job_id} failed: {ev.error}")
        raise RuntimeError(f"job {job_id} ended without a result")

    def run(self, tokens: list[int], *, queue: str, tenant: str, max_tokens: int) -> tuple[JobResult, float, float]:
        t0 = time.perf_counter()
        job = submit(self.conn, self.spec(tokens, tenant, max_tokens), queue=queue, attempts=1)
        return self.collect(job.id, t0)

    def flush(self, worker: str) -> None:
        """A one-token job under another tenant: the worker empties its context (it never reuses across tenants)."""
        self.run(self.flush_tokens, queue=worker_queue(worker), tenant=FLUSH_TENANT, max_tokens=1)

    def wait_published(self, tokens: list[int], tenant: str, timeout_s: float) -> bool:
        """Wait until the store indexes every full chunk of ``tokens`` (publishing runs after the answer, in the background)."""
        keys = self.keys(tokens, tenant)
        deadline = time.monotonic() + timeout_s
        while self.index.deepest(keys) < len(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True


def held_tokens(req: Request, result: JobResult) -> list[int]:
    """What the worker's context holds after a job, and so what it publishes: the last generated token is never evaluated."""
    return (req.tokens + result.tokens)[: req.n + max(0, len(result.tokens) - 1)]


class KvpoolSystem:
    """kvpool workers answering through their private queues; ``cross`` empties the serving worker's context first."""

    def __init__(
        self,
        name: str,
        client: PoolClient,
        workers: list[str],
        *,
        tenant: str,
        model_label: str,
        clock: float,
        cross: bool = False,
        store: bool = True,
        publish_timeout_s: float = 120.0,
    ) -> None:
        self.name = name
        self.client = client
        self.workers = workers
        self.tenant_base = tenant
        self.tenant = tenant
        self.model_label = model_label
        self.clock = clock
        self.cross = cross
        self.store = store
        self.publish_timeout_s = publish_timeout_s
        self.measured = 0
        self.publish_stalls = 0

    def begin(self, workload: str) -> None:
        self.tenant = f"{self.tenant_base}:{workload}"
        self.measured = 0

    def end(self, workload: str) -> None:
        pass

    def _worker(self, req: Request) -> str:
        if not self.cross or req.warmup:
            return self.workers[0]
        return self.workers[(self.measured + 1) % len(self.workers)]

    def run(self, req: Request, max_tokens: int) -> Sample | None:
        worker = self._worker(req)
        if self.cross:
            self.client.flush(worker)
        result, ttft, total = self.client.run(req.tokens, queue=worker_queue(worker), tenant=self.tenant, max_tokens=max_tokens)
        # Publishing runs in the background; let it finish so it neither competes with the next
        # request (of any system) nor leaves this system's next request without its chunks.
        if (
            self.store
            and self.publish_stalls < 2
            and not self.client.wait_published(held_tokens(req, result), self.tenant, self.publish_timeout_s)
        ):
            self.publish_stalls += 1
        if req.warmup:
            return None
        self.measured += 1
        return kvpool_sample(self.name, self.model_label, req, result, ttft, total, self.clock)


def kvpool_sample(system: str, model_label: str, req: Request, r: JobResult, ttft: float, total: float, clock: float) -> Sample:
    return Sample(
        model=model_label,
        workload=req.workload,
        system=system,
        request=req.index,
        label=req.label,
        prompt_tokens=req.n,
        ttft_s=ttft,
        total_s=total,
        evaluated_tokens=r.usage.evaluated_tokens,
        reused_tokens=r.usage.cached_tokens,
        completion_tokens=r.usage.completion_tokens,
        cached_from_context=r.usage.cached_from_context,
        cached_from_store=r.usage.cached_from_store,
        worker=r.worker,
        worker_ttft_s=r.timings.first_token_s,
        lookup_s=r.timings.lookup_s,
        fetch_s=r.timings.fetch_s,
        restore_s=r.timings.restore_s,
        prompt_eval_s=r.timings.prompt_eval_s,
        at_s=time.monotonic() - clock,
        loadavg_1m=_loadavg(),
    )


def run_batch(
    client: PoolClient, queue: str, tenant: str, requests: list[Request], max_tokens: int, *, system: str, model_label: str, clock: float
) -> tuple[list[Sample], float]:
    """Submit every request at once to a shared queue; returns the samples (time to first token includes the wait) and the wall time."""
    results: list[tuple[JobResult, float, float] | BaseException | None] = [None] * len(requests)
    t0 = time.perf_counter()
    jobs = [submit(client.conn, client.spec(r.tokens, tenant, max_tokens), queue=queue, attempts=1).id for r in requests]

    def collect(i: int) -> None:
        try:
            results[i] = client.collect(jobs[i], t0)
        except BaseException as e:  # re-raised below, in the caller's thread
            results[i] = e

    threads = [threading.Thread(target=collect, args=(i,), daemon=True) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    samples = []
    for req, res in zip(requests, results):
        if isinstance(res, BaseException) or res is None:
            raise RuntimeError(f"batch request {req.label} failed: {res}")
        samples.append(kvpool_sample(system, model_label, req, *res, clock))
    return samples, wall
