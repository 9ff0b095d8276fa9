"""Time to first token of a cross-host restore against evaluating, run on a worker host by ``deploy/hosts-check.sh``.

``python -m gateway.pool.bench.hosts`` runs three in-process engines on the worker host:
``cold`` (no store), ``publisher`` (stores each prompt, across the link) and ``chooser``
(a worker that restores what the other published). For each prompt length it measures
the time to first token evaluated cold, publishes the prompt at ``--publish-rate`` (a
slow link need not carry the uploads: a worker there restores what faster hosts
published), then at each ``--rate`` measures it restored (the chooser made to restore
whatever it finds) and as the worker chooses by its own estimates (`worker.cache.restore_choice`,
taught by the two runs before), and prints one JSON line per length and rate.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import click

from store.store import Store
from worker.answering import Engine
from worker.protocol import SamplingParams, job_spec
from worker.settings import WorkerSettings


def ttft(engine: Engine, tokens: list[int]) -> dict[str, float | int]:
    """One job of one generated token on ``engine``: its time to first token and what it reused."""
    spec = job_spec(
        tokens,
        model=engine.fingerprint,
        chunk_size=engine.settings.chunk_size,
        sampling=SamplingParams(max_tokens=1, temperature=0.0, top_k=1),
    )
    t0 = time.perf_counter()
    result = engine.run(spec, lambda _ev: True)
    took = time.perf_counter() - t0
    engine.after_answer()
    if engine.publisher is not None:
        engine.publisher.wait_idle()
    return {
        "ttft_s": round(took, 4),
        "cached_store": result.usage.cached_from_store,
        "evaluated": result.usage.evaluated_tokens,
        "first_token": result.tokens[0],
    }


def prompt_of(engine: Engine, n: int, salt: str) -> list[int]:
    """``n`` tokens of the README, repeated, after a line that makes the prompt unlike any before it."""
    text = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    tokens = engine.llm.tokenize(f"run {salt}\n".encode(), add_bos=True)
    body = engine.llm.tokenize(text.encode(), add_bos=False)
    while len(tokens) < n:
        tokens += body
    return tokens[:n]


def shaper(script: Path | None) -> Callable[[str], None]:
    """Sets the link's rate with ``script RATE`` (`deploy/hosts-shape.sh`); without a script, the link is left as it is."""

    def shape(rate: str) -> None:
        if script is not None and rate:
            subprocess.run(["bash", str(script), rate], check=True)

    return shape


def measure(
    engines: dict[str, Engine], n: int, salt: str, rates: list[str], shape: Callable[[str], None], publish_rate: str
) -> Iterator[dict[str, object]]:
    """The prompt evaluated cold and published at ``publish_rate`` once; then, at each of ``rates``, restored and chosen.

    At each rate the chooser starts with no estimate of its restores (a worker on that
    link), learns one from the restore it is made to make, and then chooses.
    """
    cold, publisher, chooser = engines["cold"], engines["publisher"], engines["chooser"]
    tokens = prompt_of(cold, n, salt)
    cold.forget_context()
    evaluated = ttft(cold, tokens)
    chooser.finder.eval_rate.observe(n, float(evaluated["ttft_s"]))  # what the chooser would have learnt evaluating it
    shape(publish_rate)
    ttft(publisher, tokens)
    publisher.forget_context()
    rate = chooser.finder.eval_rate.tokens_per_s
    for link in rates:
        shape(link)
        learnt = chooser.finder.restore_rate
        learnt.bytes_per_s = learnt.bytes_per_token = None
        chooser.forget_context()
        chooser.finder.eval_rate.tokens_per_s = 1e-6  # made to restore: evaluating looks endless
        restored = ttft(chooser, tokens)
        chooser.finder.eval_rate.tokens_per_s = rate
        chooser.forget_context()
        chosen = ttft(chooser, tokens)
        yield {
            "rate": link,
            "published_at": publish_rate,
            "tokens": n,
            "same_first_token": evaluated["first_token"] == restored["first_token"] == chosen["first_token"],
            "cold": evaluated,
            "restore": restored,
            "chosen": {**chosen, "choice": "restore" if chosen["cached_store"] else "evaluate"},
            "chosen_vs_cold": round(float(chosen["ttft_s"]) / float(evaluated["ttft_s"]), 4),
            "cold_vs_restore": round(float(evaluated["ttft_s"]) / float(restored["ttft_s"]), 2),
            "restore_bytes_per_s": round(learnt.bytes_per_s or 0),
            "bytes_per_token": round(learnt.bytes_per_token or 0),
            "eval_tokens_per_s": round(rate or 0, 1),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "threads": cold.settings.n_threads,
        }


@click.command()
@click.option("--model", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True)
@click.option("--lengths", default="2048,8192", help="Prompt lengths, comma-separated.")
@click.option("--salt", default="", help="Makes the prompts unlike those of an earlier run against the same store.")
@click.option(
    "--shape",
    "shape_script",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Sets the link's rate (deploy/hosts-shape.sh).",
)
@click.option("--publish-rate", default="", help="The link's rate while the prompt is published (with --shape).")
@click.option("--rate", "rates", multiple=True, help="A link rate to restore at (with --shape; repeatable). Without: the link as it is.")
def main(model: Path, lengths: str, salt: str, shape_script: Path | None, publish_rate: str, rates: tuple[str, ...]) -> None:
    """Settings come from KVPOOL_* variables (the store and Redis across the link)."""
    ns = [int(x) for x in lengths.split(",")]
    settings = WorkerSettings(n_ctx=max(ns) + 64, chunk_size=256, n_batch=512, settle_idle_s=0.01)
    store = Store.open(settings)
    engines = {
        "cold": Engine.open(settings.model_copy(update={"publish": False}), model, store=None, name="cold"),
        "publisher": Engine.open(settings, model, store=store, name="publisher"),
        "chooser": Engine.open(settings, model, store=store, name="chooser"),
    }
    try:
        for n in ns:
            for line in measure(engines, n, f"{salt} {n}", list(rates) or [""], shaper(shape_script), publish_rate):
                print(json.dumps(line), flush=True)
    finally:
        for e in engines.values():
            e.close()
        store.close()


if __name__ == "__main__":
    main()
