"""The Markdown report of ``kvpool bench-peers``: a table per workload and concurrency, then the targets."""

from __future__ import annotations

from typing import Any

BASE = "llama-server 1 slot"
DEFAULTS = ", defaults"
"""How the name of the system of one worker at default settings ends (``kvpool 1w x 2t, defaults``)."""
Run = dict[str, Any]


def _find(runs: list[Run], system: str, workload: str, conc: int, *, neighbour: bool = False) -> Run | None:
    """The run of the system whose name starts with ``system`` (the defaults' only if ``system`` ends as theirs does)."""
    return next(
        (
            r
            for r in runs
            if r["system"].startswith(system.removesuffix(DEFAULTS))
            and r["system"].endswith(DEFAULTS) == system.endswith(DEFAULTS)
            and r["workload"] == workload
            and r["concurrency"] == conc
            and bool(r.get("neighbour")) == neighbour
        ),
        None,
    )


def _same_answers(run: Run, base: Run | None) -> str:
    if base is None or len(base["answers"]) != len(run["answers"]):
        return "-"
    return f"{sum(a == b for a, b in zip(run['answers'], base['answers']))} / {len(run['answers'])}"


def _table(runs: list[Run], key: str, conc: int, title: str) -> list[str]:
    rows = [r for r in runs if r["workload"] == key and r["concurrency"] == conc and not r.get("neighbour")]
    base = _find(runs, BASE, key, conc)
    out = [
        f"### {key}, concurrency {conc}: {title}",
        "",
        "| system | wall s | TTFT p50 ms | TTFT p95 ms | cached / prompt tokens | completion tokens | answers as llama-server 1 slot's "
        "| wall vs llama-server 1 slot | TTFT p50 vs llama-server 1 slot |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = (f"{base['wall_s'] / r['wall_s']:.2f}x", f"{base['ttft_p50'] / r['ttft_p50']:.2f}x") if base else ("-", "-")
        out.append(
            f"| {r['system']} | {r['wall_s']:.2f} | {r['ttft_p50'] * 1000:.0f} | {r['ttft_p95'] * 1000:.0f} | "
            f"{r['cached_tokens']} / {r['prompt_tokens']} | {r['completion_tokens']} | {_same_answers(r, base)} | {ratio[0]} | {ratio[1]} |"
        )
    return [*out, ""]


def _find_batched(runs: list[Run], workload: str, conc: int) -> Run | None:
    """The run of the worker of 4 sequences (``kvpool 1w x Nt x 4 seq``)."""
    return next((r for r in runs if r["system"].endswith("4 seq") and r["workload"] == workload and r["concurrency"] == conc), None)


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _targets(runs: list[Run], decode: list[Run], keys: list[str]) -> list[str]:
    """The benchmark's targets, each with the figures it rests on."""
    out = ["### Targets", "", "| target | measured | result |", "|---|---|---|"]
    for key in keys:
        base, kv = _find(runs, BASE, key, 1), _find(runs, "kvpool 1w", key, 1)
        if base and kv:
            wall, ttft = kv["wall_s"] / base["wall_s"], kv["ttft_p50"] / base["ttft_p50"]
            out.append(
                f"| {key} c=1: kvpool 1 worker within 1.05x of llama-server 1 slot (wall and TTFT p50) "
                f"| kvpool's time over llama-server's: wall {wall:.2f}x ({kv['wall_s']:.1f} vs {base['wall_s']:.1f} s), TTFT p50 {ttft:.2f}x "
                f"({kv['ttft_p50'] * 1e3:.0f} vs {base['ttft_p50'] * 1e3:.0f} ms) | {_verdict(wall <= 1.05 and ttft <= 1.05)} |"
            )
    for key in ("W1", "W3"):
        slots, kv = _find(runs, "llama-server 4 slots", key, 4), _find(runs, "kvpool 2w", key, 4)
        if slots and kv:
            x = slots["wall_s"] / kv["wall_s"]
            out.append(
                f"| {key} c=4: kvpool 2 workers at least as fast as llama-server 4 slots "
                f"| {x:.2f}x as fast ({kv['wall_s']:.1f} vs {slots['wall_s']:.1f} s) | {_verdict(x >= 1)} |"
            )
    for key in keys:
        slots, kv = _find(runs, "llama-server 4 slots", key, 4), _find_batched(runs, key, 4)
        if slots and kv:
            x = slots["wall_s"] / kv["wall_s"]
            out.append(
                f"| {key} c=4: kvpool 1 worker of 4 sequences at least as fast as llama-server 4 slots "
                f"| {x:.2f}x as fast ({kv['wall_s']:.1f} vs {slots['wall_s']:.1f} s) | {_verdict(x >= 1)} |"
            )
    rr, kv = _find(runs, "2 llama-servers", "W3", 1), _find(runs, "kvpool 2w", "W3", 1)
    if rr and kv:
        x = rr["wall_s"] / kv["wall_s"]
        out.append(
            f"| W3 c=1: kvpool 2 workers at least 2x faster than 2 round-robin llama-servers "
            f"| {x:.2f}x as fast ({kv['wall_s']:.1f} vs {rr['wall_s']:.1f} s) | {_verdict(x >= 2)} |"
        )
    for key in keys:
        base, kv = _find(runs, BASE, key, 1, neighbour=True), _find(runs, "kvpool 1w", key, 1, neighbour=True)
        if base and kv:
            x = kv["wall_s"] / base["wall_s"]
            out.append(
                f"| {key} c=1, a busy neighbour on one core: kvpool 1 worker within 1.3x of llama-server 1 slot "
                f"| kvpool's time over llama-server's: {x:.2f}x ({kv['wall_s']:.1f} vs {base['wall_s']:.1f} s) | {_verdict(x <= 1.3)} |"
            )
    d_base = next((d for d in decode if d["system"] == BASE), None)
    d_kv = next((d for d in decode if d["system"].startswith("kvpool 1w") and not d["system"].endswith(DEFAULTS)), None)
    if d_base and d_kv:
        x = d_kv["tokens_per_s"] / d_base["tokens_per_s"]
        out.append(
            f"| decode: kvpool 1 worker at least llama-server 1 slot's tokens/s "
            f"| {x:.2f}x ({d_kv['tokens_per_s']:.0f} vs {d_base['tokens_per_s']:.0f} tokens/s) | {_verdict(x >= 1)} |"
        )
    d_slots = next((d for d in decode if d["system"] == "llama-server 4 slots"), None)
    d_seq = next((d for d in decode if d["system"].endswith("4 seq")), None)
    if d_slots and d_seq:
        x = d_seq["tokens_per_s"] / d_slots["tokens_per_s"]
        out.append(
            f"| decode, 4 streams: kvpool 1 worker of 4 sequences at least llama-server 4 slots' tokens/s "
            f"| {x:.2f}x ({d_seq['tokens_per_s']:.0f} vs {d_slots['tokens_per_s']:.0f} tokens/s) | {_verdict(x >= 1)} |"
        )
    return [*out, *_default_targets(runs, decode, keys), ""]


def _default_targets(runs: list[Run], decode: list[Run], keys: list[str]) -> list[str]:
    """One worker at default settings: at least llama-server 4 slots at 4 clients, within 1 slot's time at one."""
    out = []
    name = "kvpool 1w" + DEFAULTS
    for key in keys:
        slots, kv = _find(runs, "llama-server 4 slots", key, 4), _find(runs, name, key, 4)
        if slots and kv:
            x = slots["wall_s"] / kv["wall_s"]
            out.append(
                f"| {key} c=4: kvpool 1 worker at default settings at least as fast as llama-server 4 slots "
                f"| {x:.2f}x as fast ({kv['wall_s']:.1f} vs {slots['wall_s']:.1f} s) | {_verdict(x >= 1)} |"
            )
    for key in keys:
        base, kv = _find(runs, BASE, key, 1), _find(runs, name, key, 1)
        if base and kv:
            x = kv["wall_s"] / base["wall_s"]
            out.append(
                f"| {key} c=1: kvpool 1 worker at default settings within 1.0x of llama-server 1 slot's time "
                f"| kvpool's time over llama-server's: {x:.2f}x ({kv['wall_s']:.1f} vs {base['wall_s']:.1f} s) | {_verdict(x <= 1)} |"
            )
    d_slots = next((d for d in decode if d["system"] == "llama-server 4 slots"), None)
    d_kv = next((d for d in decode if d["system"].endswith(DEFAULTS)), None)
    if d_slots and d_kv:
        x = d_kv["tokens_per_s"] / d_slots["tokens_per_s"]
        out.append(
            f"| decode, 4 streams: kvpool 1 worker at default settings at least llama-server 4 slots' tokens/s "
            f"| {x:.2f}x ({d_kv['tokens_per_s']:.0f} vs {d_slots['tokens_per_s']:.0f} tokens/s) | {_verdict(x >= 1)} |"
        )
    return out


def _neighbour_table(runs: list[Run]) -> list[str]:
    """Each run beside its repeat with a busy neighbour on one core: time per request, and kvpool's over llama-server's."""
    busy = [r for r in runs if r.get("neighbour")]
    if not busy:
        return []
    out = [
        "### A busy neighbour on one core",
        "",
        "| system | workload | c | s per request, alone | with the neighbour | slowdown | TTFT p50 ms, alone / neighbour "
        "| vs llama-server 1 slot, with the neighbour |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in busy:
        alone = next(
            a for a in runs if a["system"] == r["system"] and a["workload"] == r["workload"] and a["concurrency"] == r["concurrency"]
        )
        base = next(
            (b for b in busy if b["system"].startswith(BASE) and b["workload"] == r["workload"] and b["concurrency"] == r["concurrency"]),
            None,
        )
        n = len(r["ttft_s"])
        vs = f"{r['wall_s'] / base['wall_s']:.2f}x" if base else "-"
        out.append(
            f"| {r['system']} | {r['workload']} | {r['concurrency']} | {alone['wall_s'] / n:.2f} | {r['wall_s'] / n:.2f} "
            f"| {r['wall_s'] / alone['wall_s']:.2f}x | {alone['ttft_p50'] * 1e3:.0f} / {r['ttft_p50'] * 1e3:.0f} "
            f"| {vs} |"
        )
    return [*out, ""]


def _provenance(facts: dict[str, Any] | None) -> list[str]:
    if not facts:
        return []
    flags = ", ".join(facts.get("cpu_flags") or []) or "none of note"
    return [
        f"Run {facts.get('date')} at commit `{facts.get('commit') or 'unknown'}` on {facts.get('cpu') or 'an unknown CPU'} "
        f"(flags: {flags}); llama-server: {facts.get('llama_server') or 'none'}.",
        "",
    ]


def report(doc: dict[str, Any], command: str, plots: list[str] | tuple[str, ...] = ()) -> str:
    runs: list[Run] = doc["runs"]
    titles: dict[str, str] = doc.get("workloads", {})
    keys = sorted({r["workload"] for r in runs})
    lines = [
        f"Model {doc['model']}, {doc['threads']} threads in all per system, context {doc['n_ctx']} per slot or worker.",
        *(
            [f"Every request asks both systems to stop at {', '.join(f'`{x}`' for x in doc['stop'])} (the chat template's end of turn)."]
            if doc.get("stop")
            else []
        ),
        "",
        *_provenance(doc.get("provenance")),
        f"Command: `{command}`",
        "",
        *[f"![{name}]({name})\n" for name in plots],
    ]
    for key in keys:
        for conc in sorted({r["concurrency"] for r in runs if r["workload"] == key}):
            lines += _table(runs, key, conc, titles.get(key, ""))
    lines += _neighbour_table(runs)
    if doc["decode"]:
        lines += ["### decode, 8 requests at concurrency 4", "", "| system | tokens | wall s | tokens/s |", "|---|---|---|---|"]
    for d in doc["decode"]:
        lines.append(f"| {d['system']} | {d['completion_tokens']} | {d['wall_s']:.2f} | {d['tokens_per_s']:.0f} |")
    lines += ["", *_targets(runs, doc["decode"], keys)]
    lines.append(
        "Ratios above 1 mean faster than llama-server with one slot. Wall times include generation, "
        "so a system that answers with fewer tokens (see the completion column) finishes sooner for that reason alone."
    )
    return "\n".join(lines) + "\n"
