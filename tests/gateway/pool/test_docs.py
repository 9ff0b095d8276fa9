"""The README's tables and deploy/.env.example are generated, so they cannot drift from the code."""

from pathlib import Path

from gateway.pool.docs import render
from gateway.settings import GatewaySettings

README = Path(__file__).resolve().parents[3] / "README.md"


def test_readme_tables_are_up_to_date() -> None:
    text = README.read_text()
    assert render(text) == text, "run `kvpool docs` to regenerate README.md"


def test_every_setting_is_documented() -> None:
    text = README.read_text()
    missing = [f"KVPOOL_{name.upper()}" for name in GatewaySettings.model_fields if f"`KVPOOL_{name.upper()}`" not in text]
    assert missing == []


def test_the_generated_files_are_up_to_date() -> None:
    """`kvpool docs --check` is what a contributor runs; it covers deploy/.env.example too."""
    from click.testing import CliRunner

    from gateway.pool.docs import docs_command

    root = README.parent
    result = CliRunner().invoke(docs_command, ["--readme", str(README), "--deploy", str(root / "deploy"), "--check"])
    assert result.exit_code == 0, result.output


def test_a_stale_env_example_fails_the_check_and_is_rewritten(tmp_path: Path) -> None:
    import shutil

    from click.testing import CliRunner

    from gateway.pool.docs import docs_command

    deploy = tmp_path / "deploy"
    shutil.copytree(README.parent / "deploy", deploy)
    shutil.copy(README, tmp_path / "README.md")
    (deploy / ".env.example").write_text("# KVPOOL_CHUNK_SIZE=1\n")
    args = ["--readme", str(tmp_path / "README.md"), "--deploy", str(deploy)]
    check = CliRunner().invoke(docs_command, [*args, "--check"])
    assert check.exit_code == 1 and ".env.example" in check.output
    assert CliRunner().invoke(docs_command, args).exit_code == 0
    assert (deploy / ".env.example").read_text() == (README.parent / "deploy" / ".env.example").read_text()
