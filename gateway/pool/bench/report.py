"""Figures from the samples, the targets, and the outputs: terminal table, JSON, Markdown report, PNG plots.

`analyze` adds to each run of the results document what the report shows (per
workload and system: time to first token p50/p95, total time, tokens evaluated and
reused, speed-up against cold; throughput; the physical floor; bytes per token; the
cost of a miss; the targets), so the JSON holds the figures as well as every sample.

Speed-ups against cold compare medians over the requests both systems answered (the
cold system may answer only a spread subset of a workload on a slow model).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from gateway.pool.bench.measure import median, pct
from gateway.pool.bench.plan import SYSTEMS
from gateway.pool.bench.workloads import WORKLOAD_TITLES

BATCH_SYSTEMS = {"kvpool-2w"}
"""Systems answering a whole workload at once: their time to first token includes the wait in the queue."""

Run = dict[str, Any]


def _by(samples: list[dict[str, Any]], workload: str, system: str) -> list[dict[str, Any]]:
    return [s for s in samples if s["workload"] == workload and s["system"] == system]


def _paired_ratio(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[float | None, float | None, int]:
    """(median TTFT of ``a``, of ``b``) over the requests both answered, and how many those are."""
    common = {s["request"] for s in a} & {s["request"] for s in b}
    ta = [s["ttft_s"] for s in a if s["request"] in common]
    tb = [s["ttft_s"] for s in b if s["request"] in common]
    return median(ta), median(tb), len(common)


def summarize(run: Run) -> list[dict[str, Any]]:
    rows = []
    samples = run["samples"]
    for wl in run["workloads"]:
        key = wl["key"]
        cold = _by(samples, key, "cold")
        for system in SYSTEMS:
            ss = _by(samples, key, system)
            if not ss:
                continue
            ttft = [s["ttft_s"] for s in ss]
            cold_p50, sys_p50, n_common = _paired_ratio(cold, ss)
            row = {
                "workload": key,
                "system": system,
                "n": len(ss),
                "ttft_p50_s": pct(ttft, 50),
                "ttft_p95_s": pct(ttft, 95),
                "total_s": sum(s["total_s"] for s in ss),
                "total_p50_s": pct([s["total_s"] for s in ss], 50),
                "prompt_tokens": sum(s["prompt_tokens"] for s in ss),
                "evaluated_tokens": sum(s["evaluated_tokens"] for s in ss),
                "reused_tokens": sum(s["reused_tokens"] for s in ss),
                "speedup_vs_cold": cold_p50 / sys_p50 if cold_p50 and sys_p50 and system not in BATCH_SYSTEMS else None,
                "speedup_pairs": n_common,
            }
            if system == "kvpool-cross":
                row["from_context_zero"] = sum(1 for s in ss if s["cached_from_context"] == 0)
                row["restored_from_store"] = sum(1 for s in ss if s["cached_from_store"] > 0)
            rows.append(row)
    return rows


def _floor(run: Run) -> dict[str, Any] | None:
    """kvpool's cross-worker time to first token on B1 against bytes / raw bandwidth + suffix-only evaluation."""
    raw = run.get("raw_get") or {}
    bws = raw.get("bytes_per_s") or []
    if not bws:
        return None
    bw = statistics.median(bws)
    samples = run["samples"]
    cross = {s["request"]: s for s in _by(samples, "shared", "kvpool-cross")}
    suffix = {s["request"]: s for s in _by(samples, "shared", "suffix-only")}
    per = []
    for i, sfx in suffix.items():
        if i not in cross:
            continue
        moved = sfx["reused_tokens"] // run["profile"]["chunk_size"] * raw["object_bytes"]
        floor = moved / bw + sfx["ttft_s"]
        per.append(
            {
                "request": i,
                "bytes": moved,
                "transfer_s": moved / bw,
                "suffix_s": sfx["ttft_s"],
                "floor_s": floor,
                "kvpool_ttft_s": cross[i]["ttft_s"],
                "ratio": cross[i]["ttft_s"] / floor,
            }
        )
    if not per:
        return None
    cold = {s["request"]: s["ttft_s"] for s in _by(samples, "shared", "cold")}
    floor_vs_cold = median([cold[p["request"]] / p["floor_s"] for p in per if p["request"] in cold])
    return {
        "floor_speedup_vs_cold": floor_vs_cold,
        "raw_get_bytes_per_s": bw,
        "raw_get_samples": len(bws),
        "kv_bytes": per[0]["bytes"],
        "transfer_s": median([p["transfer_s"] for p in per]),
        "suffix_eval_s": median([p["suffix_s"] for p in per]),
        "floor_s": median([p["floor_s"] for p in per]),
        "kvpool_cross_ttft_s": median([p["kvpool_ttft_s"] for p in per]),
        "ratio": median([p["ratio"] for p in per]),
        "per_request": per,
    }


def _miss_cost(run: Run) -> dict[str, Any] | None:
    """Store enabled vs disabled on prompts nothing shares, paired by prompt.

    Besides the ratio of the two times to first token (which carries the run-to-run
    noise of a long evaluation), the time *outside* prompt evaluation -- client-seen
    TTFT minus the worker's own prompt evaluation -- isolates what the store's lookup
    and the first-token snapshot for publishing cost.
    """
    samples = run["samples"]
    on = {s["request"]: s for s in _by(samples, "unique", "kvpool")}
    off = {s["request"]: s for s in _by(samples, "unique", "kvpool-nostore")}
    pairs = [(on[i], off[i]) for i in on if i in off]
    if not pairs:
        return None

    def outside(s: dict[str, Any]) -> float:
        return float(s["ttft_s"] - (s["prompt_eval_s"] or 0.0))

    base = median([b["ttft_s"] for _, b in pairs])
    extra = median([outside(a) - outside(b) for a, b in pairs])
    return {
        "requests": len(pairs),
        "ttft_store_p50_s": median([a["ttft_s"] for a, _ in pairs]),
        "ttft_nostore_p50_s": base,
        "added_fraction": median([a["ttft_s"] / b["ttft_s"] - 1 for a, b in pairs]),
        "prompt_eval_store_p50_s": median([a["prompt_eval_s"] for a, _ in pairs]),
        "prompt_eval_nostore_p50_s": median([b["prompt_eval_s"] for _, b in pairs]),
        "outside_eval_store_p50_s": median([outside(a) for a, _ in pairs]),
        "outside_eval_nostore_p50_s": median([outside(b) for _, b in pairs]),
        "outside_eval_added_s": extra,
        "outside_eval_added_fraction": extra / base if extra is not None and base else None,
        "lookup_p50_s": median([a["lookup_s"] for a, _ in pairs]),
    }


def _throughput(run: Run) -> dict[str, Any] | None:
    batch = run.get("batches", {}).get("docs")
    if not batch:
        return None
    samples = run["samples"]
    single = _by(samples, "docs", "kvpool")
    b = _by(samples, "docs", "kvpool-2w")
    seq = sum(s["total_s"] for s in single) if len(single) == len(b) else None
    return {
        **batch,
        "requests_per_s": batch["requests"] / batch["wall_s"],
        "prompt_tokens_per_s": sum(s["prompt_tokens"] for s in b) / batch["wall_s"],
        "single_worker_sequential_s": seq,
        "speedup_vs_single_worker": seq / batch["wall_s"] if seq else None,
    }


def _target(name: str, goal: str, measured: float | None, fmt: str, ok: bool | None, note: str = "") -> dict[str, Any]:
    return {
        "target": name,
        "goal": goal,
        "measured": measured,
        "shown": (fmt.format(measured) if measured is not None else "n/a"),
        "met": ok,
        "note": note,
    }


def targets(run: Run) -> list[dict[str, Any]]:
    rows = {(r["workload"], r["system"]): r for r in run["summary"]}
    return _w1_targets(run, rows) + _resume_targets(rows) + _store_targets(run)


def _w1_targets(run: Run, rows: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    cross, ram, disk = rows.get(("shared", "kvpool-cross")), rows.get(("shared", "llama-ram")), rows.get(("shared", "llama-disk"))
    sp = cross["speedup_vs_cold"] if cross else None
    fl = run.get("floor")
    note = (
        f"the physical floor itself is {fl['floor_speedup_vs_cold']:.1f}x faster than cold"
        if fl and fl.get("floor_speedup_vs_cold")
        else ""
    )
    out = [_target("B1 cross-worker TTFT, speed-up over cold", ">= 25x", sp, "{:.1f}x", None if sp is None else sp >= 25, note)]
    r = fl["ratio"] if fl else None
    floor_note = "floor = KV bytes / raw GET bandwidth + suffix-only evaluation"
    out.append(_target("B1 cross-worker TTFT / physical floor", "<= 1.3x", r, "{:.2f}x", None if r is None else r <= 1.3, floor_note))
    r = cross["ttft_p50_s"] / ram["ttft_p50_s"] if cross and ram else None
    out.append(_target("B1 cross-worker TTFT / LlamaRAMCache same-process hit", "<= 1.5x", r, "{:.2f}x", None if r is None else r <= 1.5))
    r = cross["ttft_p50_s"] / disk["ttft_p50_s"] if cross and disk else None
    out.append(_target("B1 cross-worker TTFT / LlamaDiskCache hit", "< 1x (ahead)", r, "{:.2f}x", None if r is None else r < 1))
    return out


def _resume_targets(rows: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """A worker that never saw a prompt resumes where another stopped: cross-worker close to same-worker."""
    out = []
    for wl, title in (("chat", "B2"), ("docs", "B3")):
        cross, same = rows.get((wl, "kvpool-cross")), rows.get((wl, "kvpool"))
        r = cross["ttft_p50_s"] / same["ttft_p50_s"] if cross and same else None
        out.append(
            _target(f"{title} cross-worker TTFT / same-worker TTFT (p50)", "<= 1.15x", r, "{:.2f}x", None if r is None else r <= 1.15)
        )
    return out


def _store_targets(run: Run) -> list[dict[str, Any]]:
    out = []
    r = (run.get("bytes_per_token") or {}).get("ratio")
    out.append(_target("stored bytes per token / theoretical KV bytes", "<= 1.01", r, "{:.4f}", None if r is None else r <= 1.01))
    miss = run.get("miss_cost")
    r = miss["added_fraction"] if miss else None
    note = ""
    if miss and miss.get("outside_eval_added_fraction") is not None:
        note = (
            f"whole TTFT, paired by prompt; outside prompt evaluation (which the store does not touch) it adds "
            f"{miss['outside_eval_added_s'] * 1e3:+.1f} ms ({miss['outside_eval_added_fraction'] * 100:+.2f}% of TTFT)"
        )
    shown = None if r is None else r * 100
    out.append(_target("miss: TTFT added by the store (B4)", "<= +3%", shown, "{:+.2f}%", None if r is None else r <= 0.03, note))
    r = (run.get("hashing") or {}).get("total_p50_s")
    shown = None if r is None else r * 1e3
    out.append(_target("chain hashing + lookup, 32k tokens (p50)", "< 5 ms", shown, "{:.2f} ms", None if r is None else r < 0.005))
    return out


def analyze(doc: dict[str, Any]) -> dict[str, Any]:
    """Add summary, floor, miss cost, throughput and targets to every run of ``doc`` (in place); returns ``doc``."""
    for run in doc["runs"]:
        run["summary"] = summarize(run)
        run["floor"] = _floor(run)
        run["miss_cost"] = _miss_cost(run)
        run["throughput"] = _throughput(run)
        run["targets"] = targets(run)
    return doc


# -- text -------------------------------------------------------------------------


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.2f}" if x < 100 else f"{x:.1f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}x"


TABLE_HEAD = ["model", "workload", "system", "n", "TTFT p50 s", "TTFT p95 s", "total s", "evaluated", "reused", "vs cold"]


def table_rows(doc: dict[str, Any]) -> list[list[str]]:
    out = []
    for run in doc["runs"]:
        for r in run["summary"]:
            out.append(
                [
                    run["model"]["label"],
                    WORKLOAD_TITLES.get(r["workload"], r["workload"]),
                    r["system"],
                    str(r["n"]),
                    _s(r["ttft_p50_s"]),
                    _s(r["ttft_p95_s"]),
                    _s(r["total_s"]),
                    str(r["evaluated_tokens"]),
                    str(r["reused_tokens"]),
                    _x(r["speedup_vs_cold"]),
                ]
            )
    return out


def print_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=160)
    t = Table(title="kvpool bench: time to first token (s), tokens evaluated vs reused", show_lines=False)
    for h in TABLE_HEAD:
        left = h in ("model", "workload", "system")
        t.add_column(h, justify="left" if left else "right", no_wrap=left)
    last = None
    for row in table_rows(doc):
        if last is not None and row[:2] != last:
            t.add_section()
        t.add_row(*row)
        last = row[:2]
    console.print(t)
    tt = Table(title="targets")
    for h in ("model", "target", "goal", "measured", ""):
        tt.add_column(h)
    for run in doc["runs"]:
        for g in run["targets"]:
            mark = "met" if g["met"] else ("MISSED" if g["met"] is False else "n/a")
            tt.add_row(run["model"]["label"], g["target"], g["goal"], g["shown"], mark)
    console.print(tt)


def rows_of(run: Run) -> list[list[str]]:
    return table_rows({"runs": [run]})


def write_json(doc: dict[str, object], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=1, default=_jsonable) + "\n")


def _jsonable(x: object) -> object:
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, float) and math.isnan(x):
        return None
    raise TypeError(f"not JSON serializable: {type(x)}")
