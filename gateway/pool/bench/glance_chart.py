"""The README's performance chart: kvpool's speed against llama-server on each workload, drawn from the glance table's reports.

The chart shows what the table says (`gateway.pool.bench.glance`): on each workload,
llama-server's time over kvpool's at one client (against 1 slot) and at four (against 4
slots), and decode's tokens/s over tokens/s. The figures it is drawn from are stamped into
the PNG (a text chunk), so ``kvpool docs --check`` compares those with the reports' own and
needs no matplotlib, and a PNG that matplotlib draws with other bytes elsewhere is still
current. ``kvpool docs`` draws it anew (the ``bench`` or ``test`` extra: matplotlib) when
they differ.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

from gateway.pool.bench.glance import CHART, Report, decode_ratio, newest, workload_ratio

NAME = CHART
"""Where the chart lives, relative to the repository."""
KEY = "kvpool-figures"
"""The PNG text chunk holding the figures the chart was drawn from."""
LAYOUT = 1
"""The drawing's version: a change to how the chart is drawn bumps it, so ``kvpool docs --check`` asks for a new one."""


def figures(bench: Path, root: Path) -> dict[str, Any]:
    """What the chart shows, from the newest reports at one and four clients (as the table chooses them)."""
    one, four = newest(bench, 1), newest(bench, 4)
    titles = {**one.doc["workloads"], **four.doc["workloads"]}
    rows: list[list[Any]] = [[key, _rounded(workload_ratio(one, key, 1)), _rounded(workload_ratio(four, key, 4))] for key in sorted(titles)]
    rows.append(["decode", _rounded(decode_ratio(one, 1)), _rounded(decode_ratio(four, 4))])
    return {
        "layout": LAYOUT,
        "model": one.doc["model"],
        "reports": [_link(r, root) for r in (one, four)],
        "dates": sorted({str(r.facts["date"]) for r in (one, four)}),
        "speed": rows,
    }


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _link(report: Report, root: Path) -> str:
    return (report.folder / "peers.md").relative_to(root).as_posix()


def drawn_from(path: Path) -> dict[str, Any] | None:
    """The figures stamped into the chart at ``path``; None when there is no chart or no stamp."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return None
    at = 8
    while at + 8 <= len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        at += 12 + length
        if kind in (b"tEXt", b"zTXt"):
            key, _, value = body.partition(b"\0")
            if key.decode("latin-1") == KEY:
                text = value.decode("latin-1") if kind == b"tEXt" else zlib.decompress(value[1:]).decode("latin-1")
                found: dict[str, Any] = json.loads(text)
                return found
    return None


def draw(figs: dict[str, Any], path: Path) -> None:
    """Draw the chart of ``figs`` into ``path``, stamped with them; raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = figs["speed"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.38
    for j, (label, color) in enumerate(
        (("1 client, against llama-server 1 slot", "#4c72b0"), ("4 clients, against llama-server 4 slots", "#dd8452"))
    ):
        xs = [i + (j - 0.5) * width for i in range(len(rows))]
        values = [row[1 + j] for row in rows]
        bars = ax.bar(
            [x for x, v in zip(xs, values, strict=True) if v is not None],
            [v for v in values if v is not None],
            width,
            label=label,
            color=color,
        )
        ax.bar_label(bars, labels=[f"{v:.2f}x" for v in values if v is not None], fontsize=8, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [row[0] for row in rows])
    ax.set_ylabel("kvpool's speed (above 1.00x: faster)")
    ax.set_title(f"kvpool's default worker against llama-server, {figs['model']}, {', '.join(figs['dates'])}", fontsize=10)
    ax.set_ylim(0, max([v for row in rows for v in row[1:] if v is not None] + [1.0]) * 1.15)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={KEY: json.dumps(figs, sort_keys=True), "Software": None})
    plt.close(fig)
