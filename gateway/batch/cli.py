"""``kvpool batch``: the progress bar and the command."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import click
import redis
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from gateway.batch.lines import Parsed, Rejected, parse_all, read_lines, result_id_of
from gateway.batch.plan import Request, plan, prepare
from gateway.batch.results import ResultFile, Tally
from gateway.batch.runner import POLL_BLOCK_MS, BatchAborted, Runner
from gateway.prepare import Preparer
from gateway.settings import GatewaySettings
from gateway.tenants import DEFAULT_TENANT, Tenant, Tenants
from store.clitools import pass_settings
from worker.advert import adverts

log = logging.getLogger("kvpool.batch")


class RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:.1f} req/s" if speed else "-- req/s", style="progress.data.speed")


def progress_bar(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[hit]}"),
        console=console,
        disable=not enabled,
        speed_estimate_period=60.0,
    )


def hit_text(tally: Tally) -> str:
    return f"store hit {tally.hit_ratio:.0%} (ideal {tally.ideal_ratio:.0%})"


def resolve_tenant(settings: GatewaySettings, tenant_id: str | None) -> Tenant:
    """Whose cache the batch uses: ``--tenant``, or the default tenant when the pool has no API keys."""
    tenants = Tenants(settings.api_keys, settings.tenant_secret)
    known = set(settings.api_keys.values())
    if tenant_id is None:
        if known:
            raise click.ClickException("KVPOOL_API_KEYS is set: name the tenant whose cache this batch uses with --tenant")
        return tenants.resolve(None)
    if known and tenant_id not in known:
        raise click.ClickException(f"unknown tenant {tenant_id!r}; KVPOOL_API_KEYS names: {', '.join(sorted(known))}")
    if not known and tenant_id != DEFAULT_TENANT:
        log.warning(
            "batch.tenant_unconfigured", extra={"tenant": tenant_id, "reason": "no KVPOOL_API_KEYS: the gateway serves only 'default'"}
        )
    return Tenant(tenant_id, tenants.salt(tenant_id))


def _require_workers(conn: redis.Redis[bytes]) -> int:
    try:
        n = len(adverts(conn))
    except redis.RedisError as e:
        raise click.ClickException(f"the job queue (Redis, KVPOOL_REDIS_URL) is unreachable: {type(e).__name__}: {e}") from None
    if not n:
        raise click.ClickException("no live worker is serving this pool (KVPOOL_REDIS_URL); start one with `kvpool worker`, then rerun")
    return n


class _Interrupted(Exception):
    """SIGTERM, raised in the main thread to unwind the run as Ctrl-C does; control flow, never an API error."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.status = 128 + signum


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted(signum)


def run_batch(
    settings: GatewaySettings,
    input_path: Path,
    output_path: Path,
    *,
    tenant: Tenant,
    window: int,
    worker_grace_s: float,
    show_progress: bool,
) -> int:
    """Run the batch; returns the exit status (0 once every line has its result line)."""
    entries = parse_all(read_lines(input_path))
    out = ResultFile(output_path).load()
    tally = Tally(lines=len(entries))
    todo = [e for e in entries if result_id_of(e) not in out.done]
    tally.already_done = len(entries) - len(todo)
    log.info(
        "batch.start",
        extra={"input": str(input_path), "output": str(output_path), "lines": len(entries), "already_done": tally.already_done},
    )
    status = 0
    if todo:
        conn = redis.Redis.from_url(
            settings.redis_url,
            socket_connect_timeout=settings.connect_timeout_s,
            socket_timeout=settings.read_timeout_s + POLL_BLOCK_MS / 1000,
        )
        if any(isinstance(e, Parsed) for e in todo):
            log.info("batch.workers", extra={"workers": _require_workers(conn), "window": window})
        previous = signal.signal(signal.SIGTERM, _on_signal)
        try:
            status = _run(
                settings, conn, todo, out, tally, tenant=tenant, window=window, worker_grace_s=worker_grace_s, show_progress=show_progress
            )
        finally:
            signal.signal(signal.SIGTERM, previous)
            out.close()
    click.echo("\n".join(tally.summary()))
    log.info(
        "batch.done",
        extra={
            "status": status,
            "answered": tally.answered,
            "failed": tally.failed,
            "rejected": tally.rejected,
            "prompt_tokens": tally.prompt_tokens,
            "cached_tokens": tally.cached_tokens,
            "ideal_tokens": tally.ideal_tokens,
            "of_ideal": round(tally.of_ideal, 4),
        },
    )
    return status


def _run(
    settings: GatewaySettings,
    conn: redis.Redis[bytes],
    todo: list[Parsed | Rejected],
    out: ResultFile,
    tally: Tally,
    *,
    tenant: Tenant,
    window: int,
    worker_grace_s: float,
    show_progress: bool,
) -> int:
    """Prepare the lines still to do, answer the rejected ones, plan and run the rest under a progress bar."""
    from worker.models.fetch import resolve_model

    try:
        preparer = Preparer(settings, resolve_model(settings))
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    console = Console(stderr=True)
    runner: Runner | None = None
    with progress_bar(console, show_progress) as bar:
        task = bar.add_task("batch", total=tally.lines, completed=tally.already_done, hit=hit_text(tally))

        def changed() -> None:
            bar.update(task, completed=tally.finished(), hit=hit_text(tally))

        try:
            requests = _requests(todo, preparer, tenant, out, tally, console, changed)
            groups = plan(requests, settings.chunk_size)
            log.info(
                "batch.planned", extra={"requests": len(requests), "groups": len(groups), "ideal_tokens": sum(r.ideal for r in requests)}
            )
            runner = Runner(
                conn, settings, preparer.model_name, groups, out, tally, window=window, worker_grace_s=worker_grace_s, on_change=changed
            )
            runner.run()
        except (KeyboardInterrupt, _Interrupted) as e:
            if runner is not None:
                runner.cancel_all()
            console.print("interrupted; rerun the same command to resume", highlight=False)
            return e.status if isinstance(e, _Interrupted) else 130
        except BatchAborted as e:
            if runner is not None:
                runner.cancel_all()
            console.print(Text.assemble(("error: ", "red"), str(e)), highlight=False)
            return 1
        except redis.RedisError as e:
            console.print(
                Text.assemble(
                    ("error: ", "red"), f"the job queue (Redis) is unreachable: {type(e).__name__}: {e}; rerun the same command to resume"
                ),
                highlight=False,
            )
            return 1
    return 0


def _requests(
    todo: list[Parsed | Rejected],
    preparer: Preparer,
    tenant: Tenant,
    out: ResultFile,
    tally: Tally,
    console: Console,
    changed: Callable[[], None],
) -> list[Request]:
    """The lines that become jobs; the others are answered with their error result at once."""
    requests: list[Request] = []
    for entry in todo:
        item = prepare(entry, preparer, tenant) if isinstance(entry, Parsed) else entry
        if isinstance(item, Request):
            requests.append(item)
            continue
        console.print(Text.assemble(("rejected ", "yellow"), item.report()), highlight=False)
        out.write(item.record())
        tally.rejected += 1
        changed()
    return requests


@click.command("batch")
@click.argument("input_path", metavar="REQUESTS.jsonl", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    "output_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Results (JSONL), appended as requests finish.",
)
@click.option("--tenant", default=None, help="Tenant whose cache the batch uses (required when KVPOOL_API_KEYS is set).")
@click.option(
    "--max-in-flight",
    type=click.IntRange(min=1),
    default=None,
    help="Jobs submitted and not yet answered (default: half of KVPOOL_MAX_WAITING_JOBS).",
)
@click.option(
    "--worker-grace",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds without any live worker before giving up.",
)
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar on stderr.")
@pass_settings(GatewaySettings)
def batch_command(
    settings: GatewaySettings,
    input_path: Path,
    output_path: Path,
    tenant: str | None,
    max_in_flight: int | None,
    worker_grace: float,
    progress: bool,
) -> None:
    """Answer a file of OpenAI batch requests over the worker pool, sharing each common prefix once.

    Results go to OUTPUT as they finish. Interrupted? Rerun the same command: the lines
    OUTPUT already answers are skipped. Settings come from KVPOOL_* variables.
    """
    window = max_in_flight or max(1, settings.max_waiting_jobs // 2)
    status = run_batch(
        settings,
        input_path,
        output_path,
        tenant=resolve_tenant(settings, tenant),
        window=window,
        worker_grace_s=worker_grace,
        show_progress=progress,
    )
    raise SystemExit(status)
