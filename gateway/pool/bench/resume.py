"""``kvpool bench-resume``: a long prompt resent to a worker that never saw it, against evaluating it cold.

Three engines of one model in this process, run one at a time with the same threads,
over a managed redis-server and a folder store:

* ``cold``: no store, its context emptied before each request;
* ``publisher``: answers the prompt once, which publishes its chunks and its tail;
* ``fresh``: its context emptied before each request, so everything it reuses comes
  from the store (what a newly started or another worker sees).

The prompt is real text (this project's README, as many tokens as asked), and then the
same prompt with a new question appended (the next turn of a chat). Times are the
worker's time to first token (`worker.protocol.Timings.first_token_s`), the median of
``--repeats`` requests each.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import click

from gateway.pool.procs import RedisServer
from store.store import Store
from worker.answering import Engine
from worker.protocol import JobResult, JobSpec, SamplingParams, TokenEvent, job_spec
from worker.settings import WorkerSettings


def _spec(engine: Engine, tokens: list[int]) -> JobSpec:
    return job_spec(
        tokens,
        model=engine.fingerprint,
        chunk_size=engine.settings.chunk_size,
        sampling=SamplingParams(max_tokens=1, temperature=0.0),
        wait_for_publish=True,
    )


def _ask(engine: Engine, tokens: list[int], *, fresh: bool) -> JobResult:
    if fresh:
        engine.forget_context()

    def emit(_: TokenEvent) -> bool:
        return True

    return engine.run(_spec(engine, tokens), emit)


def _median(fn: Callable[[], JobResult], repeats: int) -> tuple[float, JobResult]:
    results = [fn() for _ in range(repeats)]
    return statistics.median(r.timings.first_token_s for r in results), results[-1]


def measure(model: Path, n_tokens: int, threads: int, repeats: int, work: Path) -> dict[str, object]:
    with RedisServer(work / "redis") as redis_server:
        settings = WorkerSettings(
            redis_url=redis_server.url,
            store_url=str(work / "store"),
            n_ctx=max(4096, n_tokens + 256),
            n_threads=threads,
            settle_completions=False,
        )
        store = Store.open(settings)
        engines = {
            "cold": Engine.open(settings.model_copy(update={"publish": False}), model, store=None, name="cold"),
            "publisher": Engine.open(settings, model, store=store, name="publisher"),
            "fresh": Engine.open(settings, model, store=store, name="fresh"),
        }
        try:
            text = (Path(__file__).resolve().parents[3] / "README.md").read_text() * 4
            tokens = engines["cold"].llm.tokenize(text.encode(), add_bos=True)[:n_tokens]
            questions = iter(range(10**6))

            def turn() -> list[int]:  # a new question each time: the store holds the prompt, never the turn
                q = f"\nQuestion {next(questions)}: what does the store keep, and where?".encode()
                return tokens + engines["cold"].llm.tokenize(q, add_bos=False)

            cold_s, _ = _median(lambda: _ask(engines["cold"], tokens, fresh=True), repeats)
            _ask(engines["publisher"], tokens, fresh=True)
            fresh_s, fresh = _median(lambda: _ask(engines["fresh"], tokens, fresh=True), repeats)
            turn_cold_s, _ = _median(lambda: _ask(engines["cold"], turn(), fresh=True), repeats)
            turn_s, turn_r = _median(lambda: _ask(engines["fresh"], turn(), fresh=True), repeats)
        finally:
            for e in engines.values():
                e.close()
            store.close()
    return {
        "model": model.name,
        "prompt_tokens": len(tokens),
        "threads": threads,
        "repeats": repeats,
        "resent": {
            "cold_ttft_s": cold_s,
            "fresh_worker_ttft_s": fresh_s,
            "speedup": cold_s / fresh_s,
            "restored_tokens": fresh.usage.cached_from_store,
            "evaluated_tokens": fresh.usage.evaluated_tokens,
        },
        "next_turn": {
            "prompt_tokens": turn_r.usage.prompt_tokens,
            "cold_ttft_s": turn_cold_s,
            "fresh_worker_ttft_s": turn_s,
            "speedup": turn_cold_s / turn_s,
            "restored_tokens": turn_r.usage.cached_from_store,
            "evaluated_tokens": turn_r.usage.evaluated_tokens,
        },
    }


@click.command("bench-resume")
@click.option("--model", "model_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True, help="GGUF model.")
@click.option("--tokens", type=click.IntRange(min=64), default=2000, show_default=True, help="Prompt length.")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="Threads of each engine.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="Requests per measurement (median).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Also write resume.json into this folder.")
def bench_resume_command(model_path: Path, tokens: int, threads: int, repeats: int, out: Path | None) -> None:
    """Time to first token of a long prompt resent to a worker that never saw it, against cold."""
    with tempfile.TemporaryDirectory() as tmp:
        doc = measure(model_path, tokens, threads, repeats, Path(tmp))
    click.echo(json.dumps(doc, indent=2))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "resume.json").write_text(json.dumps(doc, indent=2) + "\n")
