"""deploy/.env.example lists every kvpool setting (no more), with its description and default, and every compose variable."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from gateway.pool.envfile import shown_default, stack_value
from tests.deploy import deployfiles as df

REGENERATE = "regenerate it: kvpool docs"


@pytest.fixture(scope="module")
def entries() -> dict[str, df.EnvEntry]:
    listed = df.parse_env_example(df.ENV_EXAMPLE.read_text())
    names = [e.name for e in listed]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f".env.example lists these twice: {duplicates}"
    return {e.name: e for e in listed}


def test_lists_exactly_the_settings(entries: dict[str, df.EnvEntry]) -> None:
    listed = {n for n in entries if n.startswith(df.ENV_PREFIX)}
    known = set(df.settings())
    assert len(known) > 30  # the settings classes were read
    assert not known - listed, f".env.example misses {sorted(known - listed)}; {REGENERATE}"
    assert not listed - known, f".env.example lists unknown settings {sorted(listed - known)}; {REGENERATE}"


def test_lists_every_compose_variable(entries: dict[str, df.EnvEntry]) -> None:
    """Everything docker-compose.yml reads from .env is in the example, with the compose default."""
    defaults = df.compose_defaults()
    for name in {r.name for r in df.references(df.compose_raw())}:
        assert name in entries, f"docker-compose.yml reads ${{{name}}}, which .env.example does not list; {REGENERATE}"
        assert entries[name].value == defaults[name], (
            f"{name}: .env.example shows {entries[name].value!r}, docker-compose.yml defaults to {defaults[name]!r}"
        )
    extra = {n for n in entries if not n.startswith(df.ENV_PREFIX)} - set(defaults)
    assert not extra, f".env.example lists variables docker-compose.yml does not read: {sorted(extra)}"


def test_copying_it_changes_nothing(entries: dict[str, df.EnvEntry]) -> None:
    """Every line is commented out: `cp .env.example .env` gives the defaults, and no empty value reaches a container."""
    active = sorted(n for n, e in entries.items() if e.active)
    assert not active, f"active lines in .env.example: {active}"


def test_descriptions_and_defaults(entries: dict[str, df.EnvEntry]) -> None:
    for env, setting in df.settings().items():
        comments = " ".join(entries[env].comments)
        assert setting.description and setting.description in comments, f"{env}: description missing or stale; {REGENERATE}"
        assert f"kvpool default: {shown_default(setting.default)}." in comments, f"{env}: default missing or stale; {REGENERATE}"


def test_values_are_the_stack_values(entries: dict[str, df.EnvEntry]) -> None:
    """Each line shows what the stack runs with: docker-compose.yml's value, else the image's, else kvpool's default."""
    for env in df.settings():
        expected, _ = stack_value(env, df.DEPLOY)
        assert entries[env].value == expected, f"{env}: .env.example shows {entries[env].value!r}, the stack uses {expected!r}"


def test_uncommented_values_are_valid(entries: dict[str, df.EnvEntry], monkeypatch: pytest.MonkeyPatch) -> None:
    """Uncommenting every line that has a value gives settings kvpool accepts (and means what the line says)."""
    from gateway.cli import main

    for key in list(os.environ):
        if key.startswith(df.ENV_PREFIX):
            monkeypatch.delenv(key)
    values = {n: e.value for n, e in entries.items() if n.startswith(df.ENV_PREFIX) and e.value != ""}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    try:
        s = df.AllSettings()
    except ValidationError as e:
        pytest.fail(f"the values in .env.example are not valid settings:\n{e}")
    for env, value in values.items():
        if df.settings()[env].section == "command":
            continue
        got = getattr(s, env.removeprefix(df.ENV_PREFIX).lower())
        if isinstance(got, bool):
            assert df.render_env_value(got) == value, env
        elif isinstance(got, (int, float)):
            assert got == float(value), env
        elif isinstance(got, dict):
            assert got == json.loads(value), env
        else:
            assert str(got) == value, env
    params = main.make_context("kvpool", ["store"]).params
    assert params["log_level"] == values["KVPOOL_LOG_LEVEL"]
    assert params["log_json"] is False


def test_parser_reads_both_kinds_of_line() -> None:
    text = "# about A\n# more\nA=1\n\n# about B\n# B='x y'\nC=\n"
    a, b, c = df.parse_env_example(text)
    assert (a.name, a.value, a.active, a.comments) == ("A", "1", True, ["about A", "more"])
    assert (b.name, b.value, b.active, b.comments) == ("B", "x y", False, ["about B"])
    assert (c.name, c.value, c.active, c.comments) == ("C", "", True, [])
