"""`pass_settings` hands each command its settings; a bad KVPOOL_* value is a usage error naming the variable."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from pydantic import Field

from store.clitools import pass_settings
from store.settings import StoreSettings


class ToySettings(StoreSettings):
    port: int = Field(8000, ge=0, le=65535)
    keys: dict[str, str] = Field(default_factory=dict)


@pytest.fixture(autouse=True)
def no_kvpool_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [n for n in os.environ if n.startswith("KVPOOL_")]:
        monkeypatch.delenv(name)


def toy_cli() -> tuple[click.Group, list[object]]:
    seen: list[object] = []

    @click.group()
    @pass_settings(StoreSettings)
    def root(settings: StoreSettings) -> None:
        seen.append(settings)

    @root.command()
    @click.option("--times", type=int, default=1)
    @pass_settings(ToySettings)
    def serve(settings: ToySettings, times: int) -> None:
        seen.append(settings)
        click.echo(f"port {settings.port} x{times}")

    @root.command()
    @pass_settings(StoreSettings)
    def stats(settings: StoreSettings) -> None:
        seen.append(settings)

    return root, seen


def test_the_command_gets_its_settings_and_its_options() -> None:
    root, seen = toy_cli()
    result = CliRunner().invoke(root, ["serve", "--times", "3"], env={"KVPOOL_PORT": "9000"})
    assert result.exit_code == 0, result.output
    assert result.output == "port 9000 x3\n"
    assert isinstance(seen[-1], ToySettings) and seen[-1].port == 9000


def test_a_command_asking_for_its_groups_class_gets_the_same_object() -> None:
    root, seen = toy_cli()
    assert CliRunner().invoke(root, ["stats"]).exit_code == 0
    group_settings, command_settings = seen
    assert command_settings is group_settings


def test_a_bad_value_is_a_usage_error_naming_the_variable() -> None:
    root, seen = toy_cli()
    result = CliRunner().invoke(root, ["serve"], env={"KVPOOL_PORT": "eighty"})
    assert result.exit_code == 2, result.output
    assert "Usage: root serve" in result.output
    assert "KVPOOL_PORT: Input should be a valid integer" in result.output
    assert "Traceback" not in result.output and len(seen) == 1  # the group ran, the command did not


def test_every_bad_variable_is_named_and_the_group_checks_its_own() -> None:
    root, seen = toy_cli()
    result = CliRunner().invoke(root, ["stats"], env={"KVPOOL_IO_THREADS": "0", "KVPOOL_READ_TIMEOUT_S": "-1"})
    assert result.exit_code == 2 and seen == []
    assert "KVPOOL_IO_THREADS: Input should be greater than or equal to 1" in result.output
    assert "KVPOOL_READ_TIMEOUT_S: Input should be greater than 0" in result.output


def test_a_value_that_is_not_json_is_named_and_not_echoed() -> None:
    root, _ = toy_cli()
    result = CliRunner().invoke(root, ["serve"], env={"KVPOOL_KEYS": '{"sk-secret": '})
    assert result.exit_code == 2, result.output
    assert "KVPOOL_KEYS: not valid JSON" in result.output
    assert "sk-secret" not in result.output
