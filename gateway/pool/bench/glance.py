"""Performance at a glance: the README's one table of kvpool's default worker beside llama-server, made from reports.

The table is made from the newest `kvpool bench-peers` reports of the default model under
``docs/bench/`` (newest by the date in their facts, `gateway.pool.bench.provenance`): the
one at one client (llama-server with 1 slot) and the one at four (4 slots). Every figure in
it is one of the report's own, formatted as the report formats it, so ``kvpool docs --check``
fails when the README and the reports part ways. A report without a recorded date is never
chosen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.pool.bench.provenance import of_report

MODEL = "SmolLM2-135M-Instruct.Q4_1"
"""The default model, whose reports the README shows."""
SERVER = {1: "llama-server 1 slot", 4: "llama-server 4 slots"}
CHART = "docs/glance.png"
"""The chart under the table, relative to the repository (`gateway.pool.bench.glance_chart` draws it)."""
DEFAULTS = ", defaults"
"""How the name of one kvpool worker at default settings ends in a report (``kvpool 1w x 2t, defaults``)."""


@dataclass(frozen=True)
class Report:
    folder: Path
    doc: dict[str, Any]
    facts: dict[str, Any]

    def run(self, system: str, workload: str, conc: int) -> dict[str, Any] | None:
        return next(
            (
                r
                for r in self.doc["runs"]
                if (r["system"] == system or (system == "kvpool" and r["system"].startswith("kvpool") and r["system"].endswith(DEFAULTS)))
                and r["workload"] == workload
                and r["concurrency"] == conc
                and not r.get("neighbour")
            ),
            None,
        )

    def decode(self, system: str) -> dict[str, Any] | None:
        for d in self.doc.get("decode", []):
            if d["system"] == system or (system == "kvpool" and d["system"].startswith("kvpool") and d["system"].endswith(DEFAULTS)):
                return dict(d)
        return None


def reports(bench: Path) -> list[Report]:
    """Every bench-peers report under ``bench`` whose facts are known."""
    found = []
    for path in sorted(bench.rglob("peers.json")):
        facts = of_report(path.parent)
        if facts is not None and facts.get("date"):
            found.append(Report(path.parent, json.loads(path.read_text()), facts))
    return found


def newest(bench: Path, conc: int) -> Report:
    """The newest report of the default model with llama-server's and the default worker's runs at ``conc`` clients."""
    fit = [
        r
        for r in reports(bench)
        if r.doc.get("model") == MODEL and any(r.run(SERVER[conc], w, conc) and r.run("kvpool", w, conc) for w in r.doc["workloads"])
    ]
    if not fit:
        raise ValueError(f"no bench-peers report of {MODEL} at {conc} client(s) with a recorded date under {bench}")
    return max(fit, key=lambda r: str(r.facts["date"]))


def _ratio(x: float) -> str:
    return f"{x:.2f}x, {'**win**' if round(x, 2) >= 1.0 else 'miss'}"


def workload_ratio(report: Report, workload: str, conc: int) -> float | None:
    """llama-server's wall time over the default worker's on ``workload`` at ``conc`` clients (above 1: kvpool is faster)."""
    server, kvpool = report.run(SERVER[conc], workload, conc), report.run("kvpool", workload, conc)
    return None if server is None or kvpool is None else float(server["wall_s"] / kvpool["wall_s"])


def decode_ratio(report: Report, conc: int) -> float | None:
    """The default worker's decode tokens/s over llama-server's (``conc`` picks the 1- or 4-slot server)."""
    server, kvpool = report.decode(SERVER[conc]), report.decode("kvpool")
    return None if server is None or kvpool is None else float(kvpool["tokens_per_s"] / server["tokens_per_s"])


def _cells(report: Report, workload: str, conc: int) -> list[str]:
    server, kvpool, ratio = (
        report.run(SERVER[conc], workload, conc),
        report.run("kvpool", workload, conc),
        workload_ratio(report, workload, conc),
    )
    if server is None or kvpool is None or ratio is None:
        return ["—", "—", "—"]
    return [f"{server['wall_s']:.2f} s", f"{kvpool['wall_s']:.2f} s", _ratio(ratio)]


def _decode_cells(report: Report, conc: int) -> list[str]:
    server, kvpool, ratio = report.decode(SERVER[conc]), report.decode("kvpool"), decode_ratio(report, conc)
    if server is None or kvpool is None or ratio is None:
        return ["—", "—", "—"]
    return [f"{server['tokens_per_s']:.0f} tokens/s", f"{kvpool['tokens_per_s']:.0f} tokens/s", _ratio(ratio)]


def _facts_line(one: Report, four: Report, root: Path) -> list[str]:
    def said(key: str, unknown: str = "not recorded") -> str:
        values = {str(r.facts.get(key)) for r in (one, four) if r.facts.get(key)}
        return ", ".join(sorted(values)) or unknown

    flags = {" ".join(r.facts.get("cpu_flags") or []) for r in (one, four)} - {""}
    cpu = said("cpu") + (f" ({', '.join(sorted(flags))})" if flags else "")
    links = ", ".join(f"[{n}]({(r.folder / 'peers.md').relative_to(root).as_posix()})" for n, r in (("1 client", one), ("4 clients", four)))
    return [
        f"Measured {said('date')} at commit `{said('commit')}`, CPU: {cpu}, {one.doc['threads']} threads per system, "
        f"model {one.doc['model']}, context {one.doc['n_ctx']} per slot or sequence; llama-server: {said('llama_server')}. "
        f"One run each; the reports: {links}.",
    ]


def table(bench: Path, root: Path) -> str:
    """The Markdown of the README's performance section (between its markers); paths relative to ``root``."""
    one, four = newest(bench, 1), newest(bench, 4)
    titles = {**one.doc["workloads"], **four.doc["workloads"]}
    rows = [
        "| workload | llama-server 1 slot | kvpool | kvpool's speed | llama-server 4 slots | kvpool | kvpool's speed |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in sorted(titles):
        rows.append(f"| {key}: {titles[key]} | " + " | ".join(_cells(one, key, 1) + _cells(four, key, 4)) + " |")
    rows.append("| decode, 8 requests 4 at a time | " + " | ".join(_decode_cells(one, 1) + _decode_cells(four, 4)) + " |")
    return "\n".join(
        [
            *_facts_line(one, four, root),
            "",
            "Wall time of each workload, one client at a time (left) and four at once (right); speed is llama-server's time "
            "over kvpool's (tokens/s over tokens/s for decode): above 1.00x kvpool is faster.",
            "",
            *rows,
            "",
            f"![kvpool's speed against llama-server on each workload, at 1 and 4 clients]({CHART})",
        ]
    )
