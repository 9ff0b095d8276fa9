"""``kvpool docs``: the generated parts of the docs.

The README's performance table and chart (from the newest bench-peers reports under docs/bench/,
`gateway.pool.bench.glance` and `glance_chart`; the chart is checked by the figures stamped into it), docs/settings.md (from the settings classes),
docs/metrics.md (from the registry), docs/commands.md (from the command line's own
definitions, `gateway.pool.commands`), and deploy/.env.example (`gateway.pool.envfile`). ``kvpool docs``
rewrites them; ``kvpool docs --check`` (and a test) fails when they drift from the code or
the reports.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import click
from prometheus_client import REGISTRY

from gateway.pool import commands, envfile
from gateway.pool.bench import glance, glance_chart

_OWNERS = {
    "StoreSettings": "store",
    "PoolSettings": "gateway, worker",
    "WorkerSettings": "worker",
    "GatewaySettings": "gateway",
    "command": "every command",
}


def _default(value: object) -> str:
    return "—" if value in (None, "", {}, []) else f"`{value}`"


def settings_table() -> str:
    rows = ["| variable | used by | default | meaning |", "|---|---|---|---|"]
    for env, s in envfile.settings().items():
        rows.append(f"| `{env}` | {_OWNERS[s.section]} | {_default(s.default)} | {s.description.replace('|', '/')} |")
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


ROOT = Path(__file__).resolve().parents[2]
"""The repository (the README's folder)."""


PAGES = {
    "README.md": ("performance",),
    "docs/settings.md": ("settings",),
    "docs/metrics.md": ("metrics",),
    "docs/commands.md": ("commands",),
}
"""The generated sections of each page, relative to the repository."""


def render(text: str, root: Path = ROOT, names: tuple[str, ...] = PAGES["README.md"]) -> str:
    """``text`` with its generated sections ``names`` made anew; ``root`` is the repository (docs/bench/ is read from there)."""
    sections: dict[str, Callable[[], str]] = {
        "performance": lambda: glance.table(root / "docs" / "bench", root),
        "settings": settings_table,
        "metrics": metrics_table,
        "commands": commands.page,
    }
    for name in names:
        pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
        m = pattern.search(text)
        if m is None:
            raise ValueError(f"no <!-- {name}:begin --> ... <!-- {name}:end --> section")
        text = text[: m.start()] + m.group(1) + sections[name]() + "\n" + m.group(2) + text[m.end() :]
    return text


@click.command("docs")
@click.option(
    "--readme",
    type=click.Path(path_type=Path),
    default=Path("README.md"),
    show_default=True,
    help="The README whose generated table is written or checked; docs/ beside it holds the other pages.",
)
@click.option(
    "--deploy",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("deploy"),
    show_default=True,
    help="The deploy folder whose .env.example is written or checked.",
)
@click.option("--check", is_flag=True, help="Exit 1 if a generated file is out of date instead of rewriting it.")
def docs_command(readme: Path, deploy: Path, check: bool) -> None:
    """Regenerate the README's performance table and chart (from docs/bench/), docs/settings.md, docs/metrics.md, docs/commands.md and deploy/.env.example."""
    try:
        root = readme.resolve().parent
        targets = {readme: render(readme.read_text(), root)}
        for page, names in PAGES.items():
            if page != "README.md":
                targets[root / page] = render((root / page).read_text(), root, names)
        targets[deploy / ".env.example"] = envfile.render(deploy.resolve())
        chart, figures = root / glance_chart.NAME, glance_chart.figures(root / "docs" / "bench", root)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    stale = [path for path, text in targets.items() if not path.exists() or path.read_text() != text]
    redraw = glance_chart.drawn_from(chart) != figures
    if check:
        if stale or redraw:
            raise click.ClickException(f"out of date: {', '.join(map(str, stale + [chart] * redraw))}; run `kvpool docs`")
        return
    for path in stale:
        path.write_text(targets[path])
        click.echo(f"wrote {path}")
    if redraw:
        try:
            glance_chart.draw(figures, chart)
        except ImportError:
            raise click.ClickException("the performance chart needs matplotlib: pip install 'kvpool[bench]'") from None
        click.echo(f"wrote {chart}")
