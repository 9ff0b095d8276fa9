"""docs/commands.md: every ``kvpool`` command, its usage and options, from the command line's own definitions.

The page is made by walking the click group of `gateway.cli` (and its command groups), so a
new command, option or help text shows on the page the next time ``kvpool docs`` runs, and
``kvpool docs --check`` fails until it does. Every command must be importable: a command
whose extra is not installed (`gateway.cli.NotInstalled`) stops the page rather than
showing a stand-in.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import click

from gateway.cli import NotInstalled, main


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(param: click.Parameter) -> str:
    value = param.default
    if isinstance(value, bool):
        return "on" if value else "—"
    if isinstance(value, Path):
        return f"`{value.as_posix()}`"
    if isinstance(value, (str, int, float)) and value != "":
        return f"`{value}`"
    return "—"


def _name(param: click.Parameter) -> str:
    if isinstance(param, click.Option):
        names = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
        if not param.is_flag and param.metavar:
            names += f" `{param.metavar}`"
        elif not param.is_flag:
            names += f" {param.type.name.upper()}"
        return names
    return f"`{param.metavar or (param.name or '').upper()}` (argument)"


def _help(param: click.Parameter) -> str:
    text = getattr(param, "help", None) or ""
    if isinstance(param, click.Option) and param.envvar:
        envvars = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
        text += f" (env: {', '.join(f'`{e}`' for e in envvars)})"
    if isinstance(param.type, click.Choice):
        text += f" One of: {', '.join(f'`{c}`' for c in param.type.choices)}."
    return _cell(text)


def _commands(group: click.Group, ctx: click.Context, prefix: str) -> list[tuple[str, click.Command, click.Context]]:
    """Every command under ``group``, named in full (``kvpool store gc``), groups before what they hold."""
    found = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None:
            continue
        if isinstance(command, NotInstalled):
            raise ValueError(f"the commands page needs every command: {command.help}")
        full = f"{prefix} {name}"
        sub = click.Context(command, info_name=name, parent=ctx)
        found.append((full, command, sub))
        if isinstance(command, click.Group):
            found.extend(_commands(command, sub, full))
    return found


def _section(full: str, command: click.Command, ctx: click.Context) -> list[str]:
    usage = " ".join([full, *command.collect_usage_pieces(ctx)])
    lines = [f"### `{full}`", "", inspect.cleandoc(command.help or ""), "", f"Usage: `{usage}`", ""]
    params = [p for p in command.get_params(ctx) if p is not command.get_help_option(ctx)]
    if isinstance(command, click.Group):
        subs = ", ".join(f"`{full} {n}`" for n in command.list_commands(ctx))
        lines += [f"Commands: {subs}.", ""]
    if params:
        lines += ["| option | default | meaning |", "|---|---|---|"]
        lines += [f"| {_name(p)} | {_default(p)} | {_help(p)} |" for p in params]
        lines.append("")
    return lines


def page() -> str:
    """The Markdown of docs/commands.md's generated section (between its markers)."""
    ctx = click.Context(main, info_name="kvpool")
    commands = _commands(main, ctx, "kvpool")
    rows = ["| command | what it does |", "|---|---|"]
    rows += [f"| [`{full}`](#{_anchor(full)}) | {_cell(command.get_short_help_str(limit=200))} |" for full, command, _ in commands]
    out = [*rows, "", *_section("kvpool", main, ctx)]
    for full, command, sub in commands:
        out += _section(full, command, sub)
    return "\n".join(out).rstrip("\n")


def _anchor(full: str) -> str:
    """GitHub's anchor of a ``### `kvpool store gc` `` heading."""
    return full.replace(" ", "-")
