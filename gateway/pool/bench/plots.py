"""The benchmark's plots: time to first token per workload and system, and prompt tokens evaluated against reused.

Needs the ``bench`` extra (matplotlib); without it the report is written with no plots.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gateway.pool.bench.plan import SYSTEMS
from gateway.pool.bench.workloads import WORKLOAD_TITLES


def plot(doc: dict[str, Any], out: Path) -> list[str]:
    """Write ``ttft.png`` and ``tokens.png``; returns their file names (none without the ``bench`` extra)."""
    try:
        import matplotlib
    except ImportError:
        print("no plots: matplotlib is not installed (pip install 'kvpool[bench]')", file=sys.stderr)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _ttft(plt, doc["runs"], out / "ttft.png")
    _tokens(plt, doc["runs"], out / "tokens.png")
    return ["ttft.png", "tokens.png"]


def _ttft(plt: Any, runs: list[dict[str, Any]], path: Path) -> None:
    colors = dict(zip(SYSTEMS, plt.get_cmap("tab10").colors))
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 4.2 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        wls = [w["key"] for w in run["workloads"]]
        rows = {(r["workload"], r["system"]): r for r in run["summary"]}
        systems = [s for s in SYSTEMS if any((w, s) in rows for w in wls)]
        width = 0.8 / max(1, len(systems))
        for j, s in enumerate(systems):
            xs, p50, p95 = [], [], []
            for i, w in enumerate(wls):
                r = rows.get((w, s))
                if r:
                    xs.append(i + (j - (len(systems) - 1) / 2) * width)
                    p50.append(r["ttft_p50_s"])
                    p95.append(max(0.0, r["ttft_p95_s"] - r["ttft_p50_s"]))
            hatched = s == "suffix-only"
            ax.bar(xs, p50, width, yerr=[[0] * len(p95), p95], capsize=2, label=s, color=colors[s],
                   hatch="//" if hatched else None, edgecolor="black" if hatched else "white")  # fmt: skip
        ax.set_yscale("log")
        ax.set_xticks(range(len(wls)), [WORKLOAD_TITLES.get(w, w) for w in wls])
        ax.set_ylabel("time to first token, s (p50, bar to p95)")
        ax.set_title(f"model {run['model']['label']}")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tokens(plt: Any, runs: list[dict[str, Any]], path: Path) -> None:
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 4.2 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        rows = [r for r in run["summary"] if r["system"] != "suffix-only"]
        labels = [f"{r['workload']}\n{r['system']}" for r in rows]
        ev = [r["evaluated_tokens"] / r["n"] for r in rows]
        re = [r["reused_tokens"] / r["n"] for r in rows]
        xs = range(len(rows))
        ax.bar(xs, ev, 0.7, label="evaluated", color="#d62728")
        ax.bar(xs, re, 0.7, bottom=ev, label="reused", color="#2ca02c")
        ax.set_xticks(list(xs), labels, rotation=70, fontsize=7)
        ax.set_ylabel("prompt tokens per request (mean)")
        ax.set_title(f"model {run['model']['label']}: prompt tokens evaluated vs reused")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
