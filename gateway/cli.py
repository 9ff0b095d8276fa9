"""The ``kvpool`` command. Each subcommand group lives beside the code it runs and is imported only when used."""

from __future__ import annotations

import importlib

import click

from gateway.settings import GatewaySettings
from store.clitools import pass_settings
from store.logs import configure_logging
from store.settings import StoreSettings

_GROUPS = {
    "store": "store.cli:store_group",
    "model": "worker.cli:model_group",
    "worker": "worker.cli:worker_command",
    "gateway": "gateway.cli:gateway_command",
    "up": "gateway.pool.up:up_command",
    "docs": "gateway.pool.docs:docs_command",
    "batch": "gateway.batch.cli:batch_command",
    "bench": "gateway.pool.bench.cli:bench_command",
    "bench-peers": "gateway.pool.bench.cli:bench_peers_command",
    "bench-index": "gateway.pool.bench.index_scale:bench_index_command",
    "bench-resume": "gateway.pool.bench.resume:bench_resume_command",
    "bench-decode": "gateway.pool.bench.decode:bench_decode_command",
    "bench-overhead": "gateway.pool.bench.overhead:bench_overhead_command",
}
EXTRAS = {
    "up": "pool",
    "docs": "bench",  # it draws the README's chart (matplotlib) from the benchmarks' reports
    "bench": "bench",
    "bench-peers": "bench",
    "bench-index": "bench",
    "bench-resume": "bench",
    "bench-decode": "bench",
    "bench-overhead": "bench",
}
"""The pyproject extra each command needs beyond kvpool's own dependencies (the pool tools'; a worker or gateway needs none)."""


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_GROUPS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = _GROUPS.get(name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        try:
            command: click.Command = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:
            if e.name is None or e.name.split(".")[0] in ("gateway", "worker", "store"):
                raise
            return _not_installed(name, e.name)
        return command


class NotInstalled(click.Command):
    """A stand-in for a command whose extra is not installed: listed in --help, and saying what to install when run."""


def _not_installed(name: str, missing: str) -> click.Command:
    """The stand-in of command ``name``, which needs the module ``missing``."""
    why = f"needs {missing}, which is not installed: pip install 'kvpool[{EXTRAS.get(name, 'test')}]'"

    def fail() -> None:
        raise click.ClickException(f"kvpool {name} {why}")

    settings = {"ignore_unknown_options": True, "allow_extra_args": True}
    return NotInstalled(
        name, callback=fail, help=why, short_help=f"(not installed) {why}", context_settings=settings, add_help_option=False
    )


@click.group(cls=_LazyGroup)
@click.option("--log-level", default="INFO", show_default=True, envvar="KVPOOL_LOG_LEVEL", help="Logging level.")
@click.option("--log-json", is_flag=True, envvar="KVPOOL_LOG_JSON", help="Log one JSON object per line.")
@pass_settings(StoreSettings)
def main(settings: StoreSettings, log_level: str, log_json: bool) -> None:
    """kvpool: share llama.cpp prompt state across a pool of inference workers.

    Settings come from KVPOOL_* environment variables.
    """
    configure_logging(log_level, log_json)


@click.command("gateway")
@click.option("--host", default=None, help="Listen address (default: KVPOOL_HOST).")
@click.option("--port", default=None, type=int, help="Listen port (default: KVPOOL_PORT).")
@pass_settings(GatewaySettings)
def gateway_command(settings: GatewaySettings, host: str | None, port: int | None) -> None:
    """Serve the OpenAI-compatible API over the worker pool (settings from KVPOOL_* variables)."""
    import uvicorn

    from gateway.app import create_app

    try:
        app = create_app(settings)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    uvicorn.run(app, host=host or settings.host, port=port if port is not None else settings.port, log_config=None, access_log=False)
