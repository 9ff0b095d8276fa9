"""The README's settings table and metrics list are generated, so they cannot drift from the code."""

from pathlib import Path

from gateway.cli.docs import render
from gateway.settings import GatewaySettings

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_tables_are_up_to_date() -> None:
    text = README.read_text()
    assert render(text) == text, "run `kvpool docs` to regenerate README.md"


def test_every_setting_is_documented() -> None:
    text = README.read_text()
    missing = [f"KVPOOL_{name.upper()}" for name in GatewaySettings.model_fields if f"`KVPOOL_{name.upper()}`" not in text]
    assert missing == []
