"""The whole suite as `deploy/setup.sh test` (and so CI) runs it: two passes, then where the time went.

    python -m tests.run [pytest arguments]

1. Every test not marked ``serial``, on `WORKERS` pytest-xdist workers (``KVPOOL_TEST_WORKERS``;
   a file's tests stay on one worker, so a module's shared pool starts once). Each worker has its
   own ports (`tests/conftest.py`) and its own session servers.
2. The tests marked ``serial`` (they assert a wall-clock bound, or time a process), one at a time,
   with nothing beside them.

Both passes write junit XML, and every process a test starts records its wait until ready, into
``.kvpool/test-results/`` (``KVPOOL_TEST_RESULTS``); `summary` then prints the 30 slowest tests and
the process starts that cost most, writes ``durations.json`` there, and ends on one line of counts.
Arguments that choose tests by marker (``-m``) or set the worker count (``-n``) run one plain pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = os.environ.get("KVPOOL_TEST_WORKERS", "2")
NO_TESTS = 5
"""pytest's exit status when a pass selected no test (a `-k` or a path that has no serial test)."""


def _pytest(args: list[str], env: dict[str, str]) -> int:
    rc = subprocess.call([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=env)
    print(flush=True)
    return rc


def main(argv: list[str]) -> int:
    results = Path(os.environ.get("KVPOOL_TEST_RESULTS") or ROOT / ".kvpool" / "test-results")
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    env = {**os.environ, "KVPOOL_TEST_RESULTS": str(results)}
    if any(a == "-m" or a.startswith("-n") for a in argv):
        codes = [_pytest([*argv, f"--junitxml={results / 'tests.xml'}"], env)]
    else:
        parallel = ["-n", WORKERS, "--dist", "loadfile", "-m", "not serial", f"--junitxml={results / 'parallel.xml'}"]
        codes = [
            _pytest([*parallel, *argv], env),
            _pytest(["-m", "serial", "-p", "no:xdist", f"--junitxml={results / 'serial.xml'}", *argv], env),
        ]
    counts = summary(results)
    ran = counts["passed"] + counts["failed"] + counts["errors"]
    bad = [c for c in codes if c not in (0, NO_TESTS)]
    return bad[0] if bad else (0 if ran else NO_TESTS)


def summary(results: Path, top: int = 30) -> dict[str, int]:
    """Print the slowest tests and process starts of this run, write ``durations.json``; returns the counts."""
    tests: list[tuple[float, str]] = []
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for xml in sorted(results.glob("*.xml")):
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            tests.append((float(case.get("time") or 0), name))
            outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}
            found = [outcome[c.tag] for c in case if c.tag in outcome]
            counts[found[0] if found else "passed"] += 1
    starts: list[dict[str, object]] = []
    for log in sorted(results.glob("starts-*.jsonl")):
        starts += [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    by_kind: dict[str, list[float]] = defaultdict(list)
    for s in starts:
        by_kind[str(s["what"]).split()[0] if str(s["what"]).startswith("worker") else str(s["what"])].append(float(str(s["s"])))
    tests.sort(reverse=True)
    (results / "durations.json").write_text(json.dumps({"tests": [{"test": n, "s": t} for t, n in tests], "starts": starts}, indent=1))
    print(f"===== the {top} slowest tests (of {len(tests)}; {sum(t for t, _ in tests):.0f} s in all) =====")
    for t, name in tests[:top]:
        print(f"{t:8.1f} s  {name}")
    print(f"===== process starts: {len(starts)}, {sum(sum(v) for v in by_kind.values()):.0f} s waited in all =====")
    for kind, waits in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        print(f"{sum(waits):8.1f} s  {len(waits):4d} x {kind} (longest {max(waits):.1f} s)")
    print(f"durations: {results / 'durations.json'}")
    print(f"suite: {counts['passed']} passed, {counts['failed'] + counts['errors']} failed, {counts['skipped']} skipped", flush=True)
    return counts


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
