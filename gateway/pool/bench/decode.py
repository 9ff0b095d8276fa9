"""``kvpool bench-decode``: decode tokens/s of one worker context at 1, 4, 16 ... sequences, and whether it stays exact.

For each sequence count P the model is loaded as a worker loads it (`worker.engine.context.Context`,
``KVPOOL_PARALLEL`` = P, ``n_gpu_layers`` as given), the start-up checks run on it (restore
and decode mode), and P threads, one per sequence, each evaluate a prompt of their own
and decode ``tokens`` greedy tokens in the mode the check chose, through the engine loop, as
P jobs would. Each count runs in a process of
its own (`isolated`). Reported: tokens/s over all sequences, and how many sequences' answers are
the same tokens as the same prompt decoded alone (P = 1): the promise that an answer does
not depend on what ran beside it. ``deploy/gpu-check.sh`` runs it on a CUDA build.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import click
import numpy as np

PROMPT_TOKENS = 48

T = TypeVar("T")


def _answer(view: Any, prompt: list[int], n: int, mode: Any) -> list[int]:
    """``n`` greedy tokens after ``prompt``, generated as a job generates them: sampled and stepped by the engine loop."""
    from worker.engine.decoding import step_tokens
    from worker.engine.llama_state import evaluate_prompt, last_logits

    view.reset()
    evaluate_prompt(view, prompt, 0)
    out = [int(np.argmax(last_logits(view)))]

    def next_step() -> tuple[list[int], int] | None:
        out.append(int(np.argmax(last_logits(view))))
        return step_tokens(view, out[-1], mode) if len(out) < n else None

    if n > 1:
        view.generate(*step_tokens(view, out[-1], mode), next_step)
    return out[:n]


def measure(model: Path, parallel: int, *, threads: int, tokens: int, n_gpu_layers: int, seed: int = 0) -> dict[str, Any]:
    """One sequence count: its checks, tokens/s with every sequence decoding, and the answers."""
    from worker.engine.context import Context
    from worker.engine.decoding import choose_mode
    from worker.engine.kvcache import context_cache
    from worker.settings import WorkerSettings
    from worker.startup.selfcheck import check_restore

    settings = WorkerSettings(model=str(model), parallel=parallel, n_ctx=512, n_threads=threads, n_gpu_layers=n_gpu_layers)
    context = Context(settings, model)
    llm = context.sequence(0)
    try:
        check = check_restore(llm, context_cache(llm))
        mode, why = choose_mode(llm, "auto")
        views = [context.sequence(i) for i in range(parallel)]
        rng = np.random.default_rng(seed)
        prompts = [[int(t) for t in rng.integers(3, llm.n_vocab(), PROMPT_TOKENS)] for _ in views]
        answers: list[list[int]] = [[] for _ in views]

        def run(i: int) -> None:
            answers[i] = _answer(views[i], prompts[i], tokens, mode)

        t0 = time.perf_counter()
        workers = [threading.Thread(target=run, args=(i,)) for i in range(len(views))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
    finally:
        context.close()
    return {
        "sequences": parallel,
        "restore_exact": check.exact,
        "decode_mode": str(mode),
        "decode_detail": why,
        "tokens_per_s": parallel * tokens / wall,
        "wall_s": wall,
        "prompts": prompts,
        "answers": answers,
    }


def isolated(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a fresh process, as every measurement here runs.

    A worker computes on one thread: its engine loop's. Once one thread of a process has run llama.cpp's OpenMP parallel regions, another
    thread's run about 3x slower (SmolLM2, 2 threads: 27-34 against 95-114 tokens/s, a
    one-sequence decode loop on a second thread after the first had decoded), which is not
    what a worker sees. So each sequence count, the reference answers and each stall
    measurement get a process of their own (spawned: no OpenMP state inherited).
    """
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def agreement(runs: list[dict[str, Any]], model: Path, *, threads: int, tokens: int, n_gpu_layers: int) -> list[dict[str, Any]]:
    """The runs, each with how many of its answers equal the same prompts decoded alone (one sequence per context)."""
    from worker.engine.context import Context
    from worker.engine.decoding import choose_mode
    from worker.settings import WorkerSettings

    context = Context(WorkerSettings(model=str(model), n_ctx=512, n_threads=threads, n_gpu_layers=n_gpu_layers), model)
    alone = context.sequence(0)
    try:
        mode = choose_mode(alone, "auto")[0]
        for r in runs:
            r["same_as_alone"] = sum(_answer(alone, p, tokens, mode) == a for p, a in zip(r["prompts"], r["answers"], strict=True))
    finally:
        context.close()
    return runs


def stalls(model: Path, *, threads: int, prefill_chunk: int, prompt_tokens: int = 2000, steps: int = 120) -> dict[str, Any]:
    """Time between one sequence's tokens while another's long prompt is evaluated, then while a state is restored into it.

    Sequence 0 decodes ``steps`` tokens; from its 10th step sequence 1 evaluates a
    ``prompt_tokens``-token prompt (in ``prefill_chunk`` pieces beside sequence 0's steps),
    then restores that prompt's state into sequence 2 (a task of the engine loop, between rounds). Returns
    sequence 0's gaps between tokens: before, during the prompt and during the restore.
    """
    from worker.engine.context import Context
    from worker.engine.decoding import choose_mode, decode_step
    from worker.engine.llama_state import evaluate_prompt, last_logits, read_seq_state, restore_seq_state
    from worker.settings import WorkerSettings

    settings = WorkerSettings(model=str(model), parallel=3, n_ctx=prompt_tokens + 256, n_threads=threads, prefill_chunk=prefill_chunk)
    context = Context(settings, model)
    view, other, restored = (context.sequence(i) for i in range(3))
    rng = np.random.default_rng(1)
    long_prompt = [int(t) for t in rng.integers(3, view.n_vocab(), prompt_tokens)]
    phase = ["before"]
    started = threading.Event()

    def newcomer() -> None:
        started.wait()
        phase[0] = "prompt"
        evaluate_prompt(other, long_prompt, 0)
        phase[0] = "restore"
        restore_seq_state(restored, read_seq_state(other), long_prompt)
        phase[0] = "after"

    try:
        mode = choose_mode(view, "auto")[0]
        evaluate_prompt(view, [int(t) for t in rng.integers(3, view.n_vocab(), PROMPT_TOKENS)], 0)
        t = threading.Thread(target=newcomer)
        t.start()
        gaps: dict[str, list[float]] = {"before": [], "prompt": [], "restore": [], "after": []}
        last = time.perf_counter()
        for i in range(steps):
            decode_step(view, int(np.argmax(last_logits(view))), mode)
            now = time.perf_counter()
            gaps[phase[0]].append(now - last)
            last = now
            if i == 10:
                started.set()
        t.join()
    finally:
        context.close()
    return {
        "prefill_chunk": prefill_chunk,
        "prompt_tokens": prompt_tokens,
        **{f"{k}_ms_p50": 1e3 * float(np.median(v)) for k, v in gaps.items() if v},
        **{f"{k}_ms_max": 1e3 * max(v) for k, v in gaps.items() if v},
    }


def table(runs: list[dict[str, Any]]) -> str:
    out = [
        "| sequences | decode tokens/s (all sequences) | vs 1 sequence | restore exact | decode mode | answers as decoded alone |",
        "|---|---|---|---|---|---|",
    ]
    base = runs[0]["tokens_per_s"]
    for r in runs:
        out.append(
            f"| {r['sequences']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | {r['restore_exact']} | {r['decode_mode']} "
            f"| {r.get('same_as_alone', '-')} / {r['sequences']} |"
        )
    return "\n".join(out)


@click.command("bench-decode")
@click.option("--model", "model_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="GGUF model  [default: SmolLM2]")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="llama.cpp threads of the context.")
@click.option("--sequences", default="1,4,16", show_default=True, help="Comma-separated sequence counts (KVPOOL_PARALLEL).")
@click.option("--tokens", type=click.IntRange(min=2), default=64, show_default=True, help="Tokens each sequence decodes.")
@click.option("--n-gpu-layers", type=int, default=0, show_default=True, help="Layers offloaded to a GPU (999: all).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Also write the runs as JSON here.")
@click.option(
    "--stalls",
    "stall_chunks",
    default="",
    help="Comma-separated KVPOOL_PREFILL_CHUNK values: also measure a decoding sequence's time between tokens while a "
    "2,000-token prompt arrives beside it, then while a state is restored (CPU).",
)
def bench_decode_command(
    model_path: Path | None, threads: int, sequences: str, tokens: int, n_gpu_layers: int, out: Path | None, stall_chunks: str
) -> None:
    """Decode tokens/s of one worker context at several sequence counts, and whether its answers stay exact."""
    from worker.cpus import quiet_openmp

    quiet_openmp()  # OpenMP's threads wait as a worker's do (before llama_cpp is loaded)
    from worker.models.packaged import DEFAULT_MODEL, ensure_packaged

    model = model_path or ensure_packaged(DEFAULT_MODEL, Path(".kvpool/models"))
    counts = sorted({int(s) for s in sequences.split(",") if s.strip()})
    runs = [isolated(measure, model, p, threads=threads, tokens=tokens, n_gpu_layers=n_gpu_layers) for p in counts]
    runs = isolated(agreement, runs, model, threads=threads, tokens=tokens, n_gpu_layers=n_gpu_layers)
    click.echo(
        f"Model {model.name}, {threads} threads, n_gpu_layers {n_gpu_layers}, {tokens} tokens per sequence after a {PROMPT_TOKENS}-token prompt"
    )
    click.echo(table(runs))
    found = [isolated(stalls, model, threads=threads, prefill_chunk=int(c)) for c in stall_chunks.split(",") if c.strip()]
    for f in found:
        click.echo(json.dumps(f))
    if out is not None:
        doc = {"runs": [{k: v for k, v in r.items() if k not in ("prompts", "answers")} for r in runs], "stalls": found}
        out.write_text(json.dumps(doc, indent=1))
