"""The generated docs (the README's performance table, docs/settings.md, docs/metrics.md, docs/commands.md, deploy/.env.example) cannot drift from the code or the reports."""

import re
from pathlib import Path

from gateway.pool import envfile
from gateway.pool.bench import glance, glance_chart
from gateway.pool.docs import PAGES, render

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
SETTINGS = ROOT / "docs" / "settings.md"


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


def test_generated_pages_are_up_to_date() -> None:
    for page, names in PAGES.items():
        text = (ROOT / page).read_text()
        assert render(text, ROOT, names) == text, f"run `kvpool docs` to regenerate {page}"


def test_every_setting_is_in_the_settings_table() -> None:
    """Each settings class's fields and the root command's own variables (KVPOOL_LOG_LEVEL, KVPOOL_LOG_JSON)."""
    listed = settings_table_variables(SETTINGS.read_text())
    assert {"KVPOOL_CHUNK_SIZE", "KVPOOL_N_BATCH", "KVPOOL_PORT", "KVPOOL_MODEL_CACHE", "KVPOOL_LOG_LEVEL"} <= set(envfile.settings())
    assert sorted(set(envfile.settings()) - listed) == []


def test_every_variable_the_code_names_is_in_the_settings_table() -> None:
    """A KVPOOL_* variable read by hand (os.environ, a click envvar, a help text) and missing from the table fails here."""
    named = variables_named_in_code()
    assert len(named) > 20 and "KVPOOL_MODEL_SHA256" in named and "KVPOOL_S3_ACCESS_KEY_ID" in named  # the scan reads the code
    listed = settings_table_variables(SETTINGS.read_text())
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
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (deploy / ".env.example").write_text("# KVPOOL_CHUNK_SIZE=1\n")
    args = ["--readme", str(tmp_path / "README.md"), "--deploy", str(deploy)]
    check = CliRunner().invoke(docs_command, [*args, "--check"])
    assert check.exit_code == 1 and ".env.example" in check.output
    assert CliRunner().invoke(docs_command, args).exit_code == 0
    assert (deploy / ".env.example").read_text() == (README.parent / "deploy" / ".env.example").read_text()


def performance_section(readme: str) -> str:
    return readme.split("<!-- performance:begin -->", 1)[1].split("<!-- performance:end -->", 1)[0]


def test_every_figure_of_the_performance_table_is_in_the_report_it_links() -> None:
    section = performance_section(README.read_text())
    reports = re.findall(r"\]\((docs/bench/[^)]+/peers\.md)\)", section)
    assert len(reports) == 2, section
    said = " ".join((ROOT / r).read_text() for r in reports)
    figures = re.findall(r"\b\d+\.\d+x|\b\d+\.\d\d(?= s\b)|\b\d+(?= tokens/s)", section)
    assert len(figures) > 20
    assert [f for f in figures if f not in said] == []
    readme = README.read_text().replace(section, "")
    assert re.findall(r"\b\d+\.\d+x\b|\b\d+(?:\.\d+)? tokens/s", readme) == [], "no figure outside the generated table"


def test_the_docs_check_fails_when_the_table_and_the_report_part_ways(tmp_path: Path) -> None:
    import json
    import shutil

    from click.testing import CliRunner

    from gateway.pool.docs import docs_command

    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(README, tmp_path / "README.md")
    args = ["--readme", str(tmp_path / "README.md"), "--deploy", str(tmp_path / "deploy"), "--check"]
    assert CliRunner().invoke(docs_command, args).exit_code == 0
    four = glance.newest(tmp_path / "docs" / "bench", 4)  # the report the table's four-client column comes from
    report = four.folder / "peers.json"
    doc = json.loads(report.read_text())
    w1 = next(r for r in doc["runs"] if r["system"] == glance.SERVER[4] and r["workload"] == "W1" and r["concurrency"] == 4)
    w1["wall_s"] += 1.0  # llama-server 4 slots' W1, one second slower
    report.write_text(json.dumps(doc))
    check = CliRunner().invoke(docs_command, args)
    assert check.exit_code == 1 and "README.md" in check.output and "glance.png" in check.output
    assert CliRunner().invoke(docs_command, args[:-1]).exit_code == 0  # `kvpool docs` writes the table and the chart anew
    assert f"{w1['wall_s']:.2f} s" in performance_section((tmp_path / "README.md").read_text())
    drawn = glance_chart.drawn_from(tmp_path / glance_chart.NAME)
    kvpool_w1 = four.run("kvpool", "W1", 4)
    assert kvpool_w1 is not None and drawn is not None
    assert drawn["speed"][0][0] == "W1" and drawn["speed"][0][2] == round(w1["wall_s"] / kvpool_w1["wall_s"], 2)
    assert CliRunner().invoke(docs_command, args).exit_code == 0


def test_the_chart_shows_the_tables_figures_and_is_checked_by_them() -> None:
    """The chart under the table is drawn from the same reports; the figures it was drawn from are stamped into it."""
    section = performance_section(README.read_text())
    assert f"]({glance_chart.NAME})" in section
    drawn = glance_chart.drawn_from(ROOT / glance_chart.NAME)
    assert drawn == glance_chart.figures(ROOT / "docs" / "bench", ROOT)
    assert [f"{row[0]}: " for row in drawn["speed"][:-1]] == re.findall(r"^\| (W\d: )", section, re.M)
    speeds = [f"{v:.2f}x" for row in drawn["speed"] for v in row[1:] if v is not None]
    assert speeds == re.findall(r"(\d+\.\d\dx), (?:\*\*win\*\*|miss)", section)
    assert all(link in section for link in drawn["reports"])


def test_a_chart_drawn_from_other_figures_fails_the_check(tmp_path: Path) -> None:
    import shutil

    from click.testing import CliRunner

    from gateway.pool.docs import docs_command

    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(README, tmp_path / "README.md")
    chart = tmp_path / glance_chart.NAME
    figures = glance_chart.figures(tmp_path / "docs" / "bench", tmp_path)
    glance_chart.draw({**figures, "speed": [["W1", 1.5, 2.0]]}, chart)
    args = ["--readme", str(tmp_path / "README.md"), "--deploy", str(tmp_path / "deploy")]
    check = CliRunner().invoke(docs_command, [*args, "--check"])
    assert check.exit_code == 1 and "glance.png" in check.output and "README.md" not in check.output
    chart.write_bytes(b"not a png")
    assert glance_chart.drawn_from(chart) is None
    assert CliRunner().invoke(docs_command, args).exit_code == 0
    assert glance_chart.drawn_from(chart) == figures


def test_the_bench_index_lists_every_report_and_docs_name_no_local_path() -> None:
    bench = ROOT / "docs" / "bench"
    index = (bench / "README.md").read_text()
    reports = [p.relative_to(bench).as_posix() for p in bench.rglob("*.md") if p != bench / "README.md"]
    assert [r for r in reports if f"[{r}]({r})" not in index] == []
    for row in re.findall(r"^\| \[[^]]+\]\([^)]+\) \|.*$", index, re.M):
        assert re.search(r"\| \d{4}-\d\d-\d\d \| `[0-9a-f]{7,}` \| [a-z-]+ \| (current|superseded|notes) \|$", row), row
    local = re.compile(r"(/work/|/root/|/home/|/tmp/)")
    found = [
        str(p)
        for p in (ROOT / "docs").rglob("*")
        if p.is_file() and p.suffix != ".py" and p.suffix != ".png" and local.search(p.read_text(errors="replace"))
    ]
    assert found == []


def test_a_stale_commands_page_fails_the_check_and_is_rewritten(tmp_path: Path) -> None:
    """docs/commands.md is the command line's own definitions: a page that lost an option fails `kvpool docs --check`."""
    import shutil

    from click.testing import CliRunner

    from gateway.pool.docs import docs_command

    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(README, tmp_path / "README.md")
    page = tmp_path / "docs" / "commands.md"
    current = page.read_text()
    assert "| `--max-bytes` TEXT |" in current and "### `kvpool store gc`" in current and "### `kvpool bench-peers`" in current
    page.write_text(current.replace("| `--max-bytes` TEXT |", "| `--budget` TEXT |"))
    args = ["--readme", str(tmp_path / "README.md"), "--deploy", str(tmp_path / "deploy")]
    check = CliRunner().invoke(docs_command, [*args, "--check"])
    assert check.exit_code == 1 and "commands.md" in check.output
    assert CliRunner().invoke(docs_command, args).exit_code == 0
    assert page.read_text() == current


def test_the_commands_page_names_every_command_and_option_of_the_command_line() -> None:
    import click

    from gateway.cli import main

    page = (ROOT / "docs" / "commands.md").read_text()
    ctx = click.Context(main, info_name="kvpool")
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        assert command is not None and f"### `kvpool {name}`" in page
        for param in command.params:
            if isinstance(param, click.Option):
                assert f"`{param.opts[0]}`" in page, (name, param.opts)


def test_every_superseded_report_names_what_superseded_it_at_its_top() -> None:
    bench = ROOT / "docs" / "bench"
    index = (bench / "README.md").read_text()
    superseded = re.findall(r"^\| \[([^]]+)\]\([^)]+\) \|.*\| superseded \|$", index, re.M)
    assert len(superseded) > 20
    for report in superseded:
        first = (bench / report).read_text().split("\n", 1)[0]
        links = re.findall(r"\]\(([^)]+)\)", first)
        assert first.startswith("> Superseded by [") and links, report
        for link in links:
            successor = ((bench / report).parent / link).resolve().relative_to(bench.resolve()).as_posix()
            assert f"[{successor}]({successor}) |" in index and not index.split(f"[{successor}]({successor}) |", 1)[1].split("\n", 1)[
                0
            ].endswith("| superseded |"), (report, link)
