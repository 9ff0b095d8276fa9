"""The plot of ``kvpool bench-peers``: wall time per workload and concurrency, and decode speed, per system.

Needs the ``bench`` extra (matplotlib); without it the report is written with no plot.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

NAME = "peers.png"


def plot(doc: dict[str, Any], out: Path) -> list[str]:
    """Write ``peers.png``; returns the file names written (none without the ``bench`` extra)."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'kvpool[bench]')", file=sys.stderr)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: list[dict[str, Any]] = doc["runs"]
    systems = list(dict.fromkeys(r["system"] for r in runs))
    cases = list(dict.fromkeys((r["workload"], r["concurrency"]) for r in runs))
    walls = {(r["workload"], r["concurrency"], r["system"]): r["wall_s"] for r in runs}
    cmap = plt.get_cmap("tab10")
    colors = {system: cmap(i % cmap.N) for i, system in enumerate(systems)}
    fig, (ax, dx) = plt.subplots(2, 1, figsize=(12, 9), gridspec_kw={"height_ratios": [2, 1]})
    width = 0.8 / max(1, len(systems))
    for j, system in enumerate(systems):
        xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(cases))]
        ax.bar(xs, [walls.get((w, c, system), 0.0) for w, c in cases], width, label=system, color=colors[system])
    ax.set_xticks(range(len(cases)), [f"{w} c={c}" for w, c in cases])
    ax.set_ylabel("wall time of the workload, s (lower is better)")
    ax.set_title(f"{doc['model']}, {doc['threads']} threads in all per system")
    ax.legend(fontsize=8)
    decode = doc.get("decode", [])
    dx.barh([d["system"] for d in decode], [d["tokens_per_s"] for d in decode], color=[colors.get(d["system"], "grey") for d in decode])
    dx.set_xlabel("decode, tokens/s (8 requests of 128 tokens, 4 at once; higher is better)")
    fig.tight_layout()
    fig.savefig(out / NAME, dpi=90)
    plt.close(fig)
    return [NAME]
