"""Generated parts of the README: the settings table (from the settings classes) and the metrics list (from the registry).

``kvpool docs`` rewrites the marked sections of README.md; a test fails when they drift.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
from prometheus_client import REGISTRY
from pydantic.fields import FieldInfo

from gateway.settings import GatewaySettings
from store.settings import StoreSettings
from worker.settings import WorkerSettings

_OWNERS = [(StoreSettings, "store"), (WorkerSettings, "worker"), (GatewaySettings, "gateway")]


def _default(field: FieldInfo) -> str:
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value in (None, "", {}, []):
        return "—"
    return f"`{value}`"


def settings_table() -> str:
    rows = ["| variable | used by | default | meaning |", "|---|---|---|---|"]
    seen: set[str] = set()
    for cls, owner in _OWNERS:
        for name, field in cls.model_fields.items():
            if name in seen:
                continue
            seen.add(name)
            rows.append(f"| `KVPOOL_{name.upper()}` | {owner} | {_default(field)} | {(field.description or '').replace('|', '/')} |")
    return "\n".join(rows)


def metrics_table() -> str:
    import gateway.metrics  # noqa: F401 -- registers the metrics
    import store.metrics  # noqa: F401
    import worker.metrics  # noqa: F401

    rows = ["| metric | type | meaning |", "|---|---|---|"]
    for family in sorted(REGISTRY.collect(), key=lambda f: f.name):
        if family.name.startswith("kvpool_"):
            suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
            rows.append(f"| `{family.name}{suffix}` | {family.type} | {family.documentation} |")
    return "\n".join(rows)


SECTIONS = {"settings": settings_table, "metrics": metrics_table}


def render(readme: str) -> str:
    for name, make in SECTIONS.items():
        pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
        if not pattern.search(readme):
            raise ValueError(f"README has no <!-- {name}:begin --> ... <!-- {name}:end --> section")
        readme = pattern.sub(lambda m, make=make: m.group(1) + make() + "\n" + m.group(2), readme)
    return readme


@click.command("docs")
@click.option("--readme", type=click.Path(path_type=Path), default=Path("README.md"), show_default=True)
@click.option("--check", is_flag=True, help="Exit 1 if the README is out of date instead of rewriting it.")
def docs_command(readme: Path, check: bool) -> None:
    """Regenerate the README's settings table and metrics list."""
    text = readme.read_text()
    try:
        new = render(text)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if check:
        if new != text:
            raise click.ClickException("README.md is out of date: run `kvpool docs`")
        return
    readme.write_text(new)
    click.echo(f"updated {readme}")
