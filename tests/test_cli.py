"""Every ``kvpool`` command: it documents each option, and a bad value for one is a usage error naming it.

The commands are found from the root command's table, so a new command is covered as soon as
it exists; each is invoked through click (no process, no pool), with a value its option's
type refuses.
"""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from gateway.cli import main

BAD_VALUES: dict[type[click.ParamType], str] = {
    click.types.IntParamType: "many",
    click.types.FloatParamType: "soon",
    click.types.IntRange: "-999999999",
    click.types.FloatRange: "-1e30",
    click.Choice: "no-such-choice",
}


def _commands() -> list[tuple[str, click.Command]]:
    """Every leaf command, named as a user types it (``store gc``, ``bench-peers``...)."""
    ctx = click.Context(main)
    found: list[tuple[str, click.Command]] = []

    def walk(prefix: str, group: click.Group, ctx: click.Context) -> None:
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            assert cmd is not None, f"kvpool {prefix}{name} is listed but cannot be loaded"
            if isinstance(cmd, click.Group):
                walk(f"{prefix}{name} ", cmd, ctx)
            else:
                found.append((f"{prefix}{name}", cmd))

    walk("", main, ctx)
    return found


COMMANDS = _commands()


def _typed_options(cmd: click.Command) -> list[tuple[click.Option, str]]:
    out = []
    for p in cmd.params:
        if isinstance(p, click.Option) and not p.is_flag:
            bad = next((v for t, v in BAD_VALUES.items() if type(p.type) is t), None)
            if bad is not None:
                out.append((p, bad))
    return out


@pytest.mark.parametrize(("name", "cmd"), COMMANDS, ids=[n for n, _ in COMMANDS])
def test_each_command_explains_itself_and_every_option(name: str, cmd: click.Command) -> None:
    result = CliRunner().invoke(main, [*name.split(), "--help"])
    assert result.exit_code == 0, result.output
    assert (cmd.help or "").strip(), f"kvpool {name} has no help text"
    for p in cmd.params:
        if isinstance(p, click.Option) and not p.hidden:
            assert p.help, f"kvpool {name} {p.opts[0]} has no help text"
            assert p.opts[-1] in result.output


CASES = [(name, opt, bad) for name, cmd in COMMANDS for opt, bad in _typed_options(cmd)]


@pytest.mark.parametrize(("name", "option", "bad"), CASES, ids=[f"{n} {o.opts[-1]}" for n, o, _ in CASES])
def test_a_bad_option_value_is_a_usage_error_naming_the_option(name: str, option: click.Option, bad: str) -> None:
    result = CliRunner().invoke(main, [*name.split(), option.opts[-1], bad])
    assert result.exit_code == 2, result.output
    assert option.opts[-1] in result.output or option.opts[0] in result.output, result.output
    assert "Traceback" not in result.output


def test_the_root_command_lists_every_command() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in ("store", "model", "worker", "gateway", "up", "docs", "batch", "bench", "bench-peers", "bench-index", "bench-resume"):
        assert f"  {name} " in result.output, name


def test_an_unknown_command_is_a_usage_error() -> None:
    result = CliRunner().invoke(main, ["serve"])
    assert result.exit_code == 2 and "No such command 'serve'" in result.output
