"""deploy/agents_proxy.py report: how deploy/agents-check.sh judges a run from what its proxy recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROXY = Path(__file__).resolve().parents[2] / "deploy" / "agents_proxy.py"
TOOLS = {"tools": [{"name": "Bash"}, {"name": "Read"}]}


def session(folder: Path, n: int, prompt: str, start: float, end: float, rc: int, printed: str) -> None:
    for kind, text in (("prompt", prompt), ("start", str(start)), ("end", str(end)), ("rc", str(rc)), ("out", printed)):
        (folder / f"session{n}.{kind}").write_text(text + "\n")


def request(folder: Path, n: int, at: float, status: int, prompt: int, cached: int) -> dict:
    (folder / f"{n:04d}.json").write_text(json.dumps(TOOLS))
    usage = {"input_tokens": prompt - cached, "cache_read_input_tokens": cached}
    return {
        "n": n,
        "at": at,
        "method": "POST",
        "path": "/v1/messages",
        "status": status,
        "first_byte_s": 1.0,
        "total_s": 2.0,
        "usage": usage,
        "error": None,
    }


def run(work: Path, rows: list[dict]) -> tuple[int, str]:
    (work / "claude-code" / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = subprocess.run(
        [sys.executable, PROXY, "report", "--work", work, "--out", work / "out", "--model", "m"], capture_output=True, text=True
    )
    return done.returncode, (work / "out" / "report.md").read_text()


def test_the_report_says_how_each_session_ended_and_judges_its_requests_and_cache(tmp_path: Path) -> None:
    agent = tmp_path / "claude-code"
    agent.mkdir()
    session(agent, 1, "Say hello", 100.0, 200.0, 0, "Hello!\n")
    session(agent, 2, "List the files", 300.0, 2100.0, 124, "working...\nstill working")
    rows = [request(agent, 1, 110.0, 200, 1000, 0), request(agent, 2, 310.0, 200, 1000, 900), request(agent, 3, 320.0, 200, 1100, 1000)]
    rc, text = run(tmp_path, rows)
    assert rc == 1  # Codex recorded nothing: no agent is judged on nothing
    assert "## claude-code: PASS" in text and "900 of 1000 prompt tokens read from cache (90.0%)" in text
    assert "- session 1 ('Say hello'): exited with 0 after 100 s, 1 requests; it printed last: `Hello!`" in text
    assert "- session 2 ('List the files'): stopped by the timeout after 1800 s, 2 requests; it printed last: `still working`" in text

    rc, text = run(tmp_path, [*rows[:2], request(agent, 3, 320.0, 500, 1100, 0)])
    assert "## claude-code: FAIL" in text and "answered: 3, with 200: 2" in text
