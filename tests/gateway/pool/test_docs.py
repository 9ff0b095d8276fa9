"""The README's tables and deploy/.env.example are generated, so they cannot drift from the code."""

import re
from pathlib import Path

from gateway.pool import envfile
from gateway.pool.docs import render

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"


def settings_table_variables(readme: str) -> set[str]:
    """The variables the README's generated settings table lists, one per row."""
    table = readme.split("<!-- settings:begin -->", 1)[1].split("<!-- settings:end -->", 1)[0]
    return set(re.findall(r"^\| `(KVPOOL_[A-Z0-9_]+)` \|", table, re.M))


def variables_named_in_code() -> dict[str, list[str]]:
    """Every KVPOOL_* name written anywhere in gateway/, worker/ and store/, with the files naming it."""
    found: dict[str, list[str]] = {}
    for package in ("gateway", "worker", "store"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in set(re.findall(r"\bKVPOOL_[A-Z0-9]+(?:_[A-Z0-9]+)*\b", path.read_text())):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_readme_tables_are_up_to_date() -> None:
    text = README.read_text()
    assert render(text) == text, "run `kvpool docs` to regenerate README.md"


def test_every_setting_is_in_the_settings_table() -> None:
    """Each settings class's fields and the root command's own variables (KVPOOL_LOG_LEVEL, KVPOOL_LOG_JSON)."""
    listed = settings_table_variables(README.read_text())
    assert {"KVPOOL_CHUNK_SIZE", "KVPOOL_N_BATCH", "KVPOOL_PORT", "KVPOOL_MODEL_CACHE", "KVPOOL_LOG_LEVEL"} <= set(envfile.settings())
    assert sorted(set(envfile.settings()) - listed) == []


def test_every_variable_the_code_names_is_in_the_settings_table() -> None:
    """A KVPOOL_* variable read by hand (os.environ, a click envvar, a help text) and missing from the table fails here."""
    named = variables_named_in_code()
    assert len(named) > 20 and "KVPOOL_MODEL_SHA256" in named and "KVPOOL_S3_ACCESS_KEY_ID" in named  # the scan reads the code
    listed = settings_table_variables(README.read_text())
    assert {name: files for name, files in named.items() if name not in listed} == {}


def test_the_table_scan_reads_rows_only() -> None:
    text = "`KVPOOL_B` in prose\n<!-- settings:begin -->\n| variable |\n|---|\n| `KVPOOL_A` | store |\n<!-- settings:end -->\n"
    assert settings_table_variables(text) == {"KVPOOL_A"}


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
