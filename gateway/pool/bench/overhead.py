"""``kvpool bench-overhead``: what a request costs outside the model, from the client's send to the answer.

One pool of one worker (a managed redis-server, a fresh store, ``kvpool_pool``) answers
the same short chat request ``--requests`` times, one at a time, the worker idle
between them (the case of one client, where nothing else hides the cost). The first
request fills the worker's context; every later one finds its prompt there, so the
worker's own time is a short evaluation and one token. Each answer carries the
worker's timings (`worker.protocol.Timings`, in the response's ``kvpool`` field):

* ``queue_wait``: from the gateway's enqueue stamp on the job (`JobSpec.enqueued_at`)
  to the engine starting the job, plus RQ's bookkeeping after it: RQ's pop, its job
  record, the worker's heartbeat and advert, the stream's start event;
* ``worker``: the engine's time for the job (`Timings.total_s`);
* ``outside``: the client's wall time less ``worker``: HTTP, the chat template and
  tokenizer, routing and the enqueue, ``queue_wait``, and the relay of the answer back.

Reported as medians and 95th percentiles over every request but the first.
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import httpx

QUESTION = "Say hello to the user in one short sentence."
SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True)
class Sample:
    """One request: the client's wall time and the worker's own timings, in seconds."""

    wall_s: float
    worker_s: float
    queue_wait_s: float

    @property
    def outside_s(self) -> float:
        return max(0.0, self.wall_s - self.worker_s)


@dataclass(frozen=True)
class Summary:
    parallel: int
    requests: int
    wall_p50_ms: float
    worker_p50_ms: float
    queue_wait_p50_ms: float
    queue_wait_p95_ms: float
    outside_p50_ms: float
    outside_p95_ms: float


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(parallel: int, samples: list[Sample]) -> Summary:
    """Medians and 95th percentiles, in milliseconds, of every sample but the first (the one that filled the context)."""
    kept = samples[1:] or samples
    return Summary(
        parallel=parallel,
        requests=len(kept),
        wall_p50_ms=1000 * statistics.median(s.wall_s for s in kept),
        worker_p50_ms=1000 * statistics.median(s.worker_s for s in kept),
        queue_wait_p50_ms=1000 * statistics.median(s.queue_wait_s for s in kept),
        queue_wait_p95_ms=_p([s.queue_wait_s for s in kept], 0.95),
        outside_p50_ms=1000 * statistics.median(s.outside_s for s in kept),
        outside_p95_ms=_p([s.outside_s for s in kept], 0.95),
    )


def ask(client: httpx.Client, model: str) -> Sample:
    """One non-streamed chat request of one token; the wall time is the client's, the rest is the worker's report."""
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        "max_tokens": 1,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    timings = r.json()["kvpool"]["timings"]
    return Sample(wall_s=wall, worker_s=timings["total_s"], queue_wait_s=timings["queue_wait_s"])


def measure(model: Path, *, parallel: int, requests: int, threads: int, pause_s: float = 0.2) -> list[Sample]:
    """``requests`` requests to a pool of one worker of ``parallel`` sequences, ``pause_s`` apart (the worker idles between them)."""
    from gateway.pool.bench.peers import kvpool_pool

    with tempfile.TemporaryDirectory(prefix="kvpool-overhead-") as logs:
        with kvpool_pool(model, workers=1, threads=threads, n_ctx=2048, logs=Path(logs), parallel=parallel) as urls:
            samples = []
            with httpx.Client(base_url=urls[0], timeout=120) as client:
                for _ in range(requests):
                    samples.append(ask(client, model.stem))
                    time.sleep(pause_s)  # a client's think time: the next request finds the worker idle
            return samples


def report(runs: list[Summary]) -> str:
    lines = [
        "| sequences | requests | wall p50 | worker p50 | queue wait p50 / p95 | outside the worker p50 / p95 |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for s in runs:
        lines.append(
            f"| {s.parallel} | {s.requests} | {s.wall_p50_ms:.1f} ms | {s.worker_p50_ms:.1f} ms | "
            f"{s.queue_wait_p50_ms:.1f} / {s.queue_wait_p95_ms:.1f} ms | {s.outside_p50_ms:.1f} / {s.outside_p95_ms:.1f} ms |"
        )
    return "\n".join(lines)


@click.command("bench-overhead")
@click.option("--model", "model_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="GGUF model  [default: SmolLM2]")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="llama.cpp threads of the worker.")
@click.option("--sequences", default="1,4", show_default=True, help="Comma-separated KVPOOL_PARALLEL values, one pool each.")
@click.option("--requests", type=click.IntRange(min=2), default=40, show_default=True, help="Requests per pool (the first is not counted).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Also write the samples and summaries as JSON here.")
def bench_overhead_command(model_path: Path | None, threads: int, sequences: str, requests: int, out: Path | None) -> None:
    """Per-request cost outside the model: one worker, one client, a short cached prompt, one token."""
    from worker.models.packaged import DEFAULT_MODEL, ensure_packaged

    model = model_path or ensure_packaged(DEFAULT_MODEL, Path(".kvpool/models"))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the table
    runs, raw = [], {}
    for p in sorted({int(s) for s in sequences.split(",") if s.strip()}):
        samples = measure(model, parallel=p, requests=requests, threads=threads)
        runs.append(summarize(p, samples))
        raw[p] = [asdict(s) for s in samples]
    click.echo(f"Model {model.name}, 1 worker x {threads} threads, {requests} requests one at a time")
    click.echo(report(runs))
    if out is not None:
        out.write_text(json.dumps({"model": model.name, "threads": threads, "runs": [asdict(r) for r in runs], "samples": raw}, indent=1))
