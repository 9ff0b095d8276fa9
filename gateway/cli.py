"""The ``kvpool`` command. Each subcommand group lives beside the code it runs and is imported only when used."""

from __future__ import annotations

import importlib

import click
from pydantic import ValidationError

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
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_GROUPS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = _GROUPS.get(name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        command = getattr(importlib.import_module(module), attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{target} is not a click command")
        return command


@click.group(cls=_LazyGroup)
@click.option("--log-level", default="INFO", show_default=True, envvar="KVPOOL_LOG_LEVEL", help="Logging level.")
@click.option("--log-json", is_flag=True, envvar="KVPOOL_LOG_JSON", help="Log one JSON object per line.")
@click.pass_context
def main(ctx: click.Context, log_level: str, log_json: bool) -> None:
    """kvpool: share llama.cpp prompt state across a pool of inference workers.

    Settings come from KVPOOL_* environment variables.
    """
    configure_logging(log_level, log_json)
    try:
        ctx.obj = StoreSettings()
    except ValidationError as e:
        raise click.ClickException(f"bad settings: {e}") from None


@click.command("gateway")
@click.option("--host", default=None, help="Listen address (default: KVPOOL_HOST).")
@click.option("--port", default=None, type=int, help="Listen port (default: KVPOOL_PORT).")
def gateway_command(host: str | None, port: int | None) -> None:
    """Serve the OpenAI-compatible API over the worker pool (settings from KVPOOL_* variables)."""
    import uvicorn
    from pydantic import ValidationError

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    try:
        settings = GatewaySettings()
    except ValidationError as e:
        raise click.ClickException(f"bad settings: {e}") from None
    try:
        app = create_app(settings)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    uvicorn.run(app, host=host or settings.host, port=port if port is not None else settings.port, log_config=None, access_log=False)
