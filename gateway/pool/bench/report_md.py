"""The Markdown report of a benchmark run: one section per figure, from the analysed results document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.pool.bench.measure import median
from gateway.pool.bench.plan import SYSTEM_TITLES
from gateway.pool.bench.plots import plot
from gateway.pool.bench.report import TABLE_HEAD, Run, rows_of, write_json
from gateway.pool.bench.workloads import WORKLOAD_TITLES


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(doc: dict[str, Any], plots: list[str]) -> str:
    m = doc["machine"]
    parts = [
        "# kvpool bench",
        "",
        "Made by:",
        "",
        "```",
        doc["command"],
        "```",
        "",
        (
            f"Started {doc['started_at']}, took {doc['duration_s'] / 60:.1f} min. Store: {doc.get('store_endpoint', doc['store'])}. "
            f"Machine: {m['cpu']}, {m['usable_cpus']} usable CPUs, {m['memory_gb']} GB RAM, {m['platform']}, Python {m['python']}, "
            f"llama-cpp-python {m['llama_cpp_python']}. Load average at start {_load(m.get('loadavg_at_start'))}, "
            f"at end {_load(m.get('loadavg_at_end'))} (other processes on the machine share its cores)."
        ),
        "",
        (
            "Every system answers the same prompts with the same model, threads and greedy sampling (EOS banned, so each request "
            "generates the same number of tokens). Systems are interleaved request by request. Time to first token (TTFT) runs from "
            "the request to the first sampled token; for kvpool it is what the client sees, queue and Redis stream included. "
            "`vs cold` compares medians over the requests both answered."
        ),
        "",
        "Systems: " + "; ".join(f"`{k}`: {v}" for k, v in SYSTEM_TITLES.items()) + ".",
        "",
    ]
    for run in doc["runs"]:
        parts += _md_run(run)
    parts += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(parts)


def _load(x: list[float] | None) -> str:
    return "-" if not x else " / ".join(f"{v:.2f}" for v in x)


def _md_run(run: Run) -> list[str]:
    out = _md_header(run)
    out += [_md_table(TABLE_HEAD[1:], [r[1:] for r in rows_of(run)]), ""]
    for section in (_md_cross, _md_floor, _md_bytes, _md_miss, _md_throughput, _md_hashing, _md_notes):
        out += section(run)
    return out


def _md_header(run: Run) -> list[str]:
    """The model, the profile, the calibration and the machine's load during the run."""
    mod, prof = run["model"], run["profile"]
    label = mod["label"]
    cal = run["calibration"]
    fl_load = run.get("foreign_load") or {}
    load_note = ""
    if fl_load.get("during_p50_cores") is not None:
        load_note = (
            f" While requests ran, other processes on the machine used {fl_load['during_p50_cores']:.2f} cores (p50, p95 "
            f"{fl_load['during_p95_cores']:.2f}); {fl_load['samples_above_half_core']} of {fl_load['samples']} samples ran "
            "while they used half a core or more (each sample's `foreign_cpu` in results.json)"
            + (
                f"; rounds waited {fl_load['waited_s']:.0f} s in all for them to drop below {fl_load['limit_cores']} cores"
                if fl_load.get("limit_cores") is not None
                else ""
            )
            + "."
        )
    out = [
        f"## Model `{label}`",
        "",
        f"`{mod['path']}` ({mod['file_bytes'] / 1e9:.2f} GB, {mod['n_layer']} layers); chunk size {prof['chunk_size']}, "
        f"context {prof['n_ctx']}, {prof['threads']} threads per system ({prof['pool_threads']} per worker in the 2-worker run), "
        f"{prof['max_tokens']} generated tokens per request"
        + (f", cold answers at most {prof['cold_repeats']} measured requests per workload" if prof.get("cold_repeats") else "")
        + f". Calibration: {cal['prompt_tokens_per_s']:.0f} prompt tokens/s, {cal['decode_s_per_token'] * 1e3:.0f} ms per generated token."
        + load_note,
        "",
        "Workloads: " + "; ".join(f"**{WORKLOAD_TITLES.get(w['key'], w['key'])}**: {w['description']}" for w in run["workloads"]) + ".",
        "",
    ]
    return out


def _md_cross(run: Run) -> list[str]:
    """Whether cross-worker requests really came from the store."""
    out: list[str] = []
    crosses = [r for r in run["summary"] if r["system"] == "kvpool-cross"]
    if crosses:
        n = sum(r["n"] for r in crosses)
        z = sum(r["from_context_zero"] for r in crosses)
        st = sum(r["restored_from_store"] for r in crosses)
        out += [
            (
                f"Cross-worker check: {z} of {n} `kvpool-cross` requests reused nothing from the serving worker's own context "
                f"(`cached_from_context` = 0); {st} restored a prefix from the store (the others had nothing to restore: first "
                "requests of a document or conversation)."
            ),
            "",
        ]
    return out


def _md_floor(run: Run) -> list[str]:
    """The physical floor of a cross-worker hit, and where kvpool's time goes."""
    out: list[str] = []
    cross = next((r for r in run["summary"] if r["workload"] == "shared" and r["system"] == "kvpool-cross"), None)
    fl = run.get("floor")
    if fl:
        out += [
            "### Physical floor of a cross-worker hit (B1)",
            "",
            (
                f"Raw GET bandwidth of the store endpoint, {run['raw_get']['objects']} objects of {run['raw_get']['object_bytes'] / 1e6:.2f} MB "
                f"fetched {run['raw_get']['threads']} at a time: {fl['raw_get_bytes_per_s'] / 1e6:.0f} MB/s (median of {fl['raw_get_samples']}). "
                f"KV bytes to move: {fl['kv_bytes'] / 1e6:.1f} MB, so {fl['transfer_s'] * 1e3:.0f} ms; suffix-only evaluation "
                f"{fl['suffix_eval_s'] * 1e3:.0f} ms. Floor {fl['floor_s'] * 1e3:.0f} ms; kvpool cross-worker TTFT "
                f"{fl['kvpool_cross_ttft_s'] * 1e3:.0f} ms = **{fl['ratio']:.2f}x the floor**."
            ),
            "",
        ]
        if cross:
            cs = [s for s in run["samples"] if s["workload"] == "shared" and s["system"] == "kvpool-cross"]
            parts = {
                k: median([s[k] for s in cs if s[k] is not None])
                for k in ("lookup_s", "fetch_s", "restore_s", "prompt_eval_s", "worker_ttft_s")
            }
            out += [
                (
                    "Where kvpool's cross-worker time goes (worker timings, medians): "
                    f"lookup {_ms(parts['lookup_s'])}, fetch + verify {_ms(parts['fetch_s'])}, join + restore {_ms(parts['restore_s'])}, "
                    f"suffix evaluation {_ms(parts['prompt_eval_s'])}; worker-side TTFT {_ms(parts['worker_ttft_s'])} against "
                    f"{_ms(cross['ttft_p50_s'])} seen by the client."
                ),
                "",
            ]
    return out


def _md_bytes(run: Run) -> list[str]:
    """Stored bytes per token against the theoretical KV size."""
    out: list[str] = []
    bpt = run.get("bytes_per_token")
    if bpt and bpt.get("stored_bytes_per_token"):
        o = bpt["overhead_per_token"]
        out += [
            "### Stored bytes per token",
            "",
            (
                f"{bpt['stored_bytes_per_token']:.1f} stored against {bpt['theoretical_kv_bytes_per_token']} theoretical (K and V rows of "
                f"{bpt['layout']['n_layer']} layers) = {bpt['ratio']:.4f}; per token the overhead is {o['cell_metadata']} bytes of cell "
                f"metadata, {o['payload_header']:.2f} of payload header and {o['blob_header']:.2f} of blob header ({bpt['chunks']} chunks)."
            ),
            "",
        ]
    return out


def _md_miss(run: Run) -> list[str]:
    """What the store costs a request it cannot help."""
    out: list[str] = []
    miss = run.get("miss_cost")
    if miss:
        out += [
            "### Cost of a miss (B4)",
            "",
            (
                f"Cold requests on a worker with the store enabled vs disabled, paired by prompt and run back to back "
                f"({miss['requests']} pairs): TTFT {miss['ttft_store_p50_s']:.3f} s vs {miss['ttft_nostore_p50_s']:.3f} s, the store adds "
                f"{miss['added_fraction'] * 100:+.2f}% (median of the pairs). Prompt evaluation alone takes {miss['prompt_eval_store_p50_s']:.3f} s "
                f"vs {miss['prompt_eval_nostore_p50_s']:.3f} s; everything else the client waits for (queue, lookup, the first-token snapshot "
                f"for publishing, the stream) {_ms(miss['outside_eval_store_p50_s'])} vs {_ms(miss['outside_eval_nostore_p50_s'])}, so the "
                f"store's own cost on a miss is {miss['outside_eval_added_s'] * 1e3:+.1f} ms ({miss['outside_eval_added_fraction'] * 100:+.2f}%), "
                f"its lookup {_ms(miss['lookup_p50_s'])}."
            ),
            "",
        ]
    return out


def _md_throughput(run: Run) -> list[str]:
    """Throughput of the 2-worker pool."""
    out: list[str] = []
    thr = run.get("throughput")
    if thr:
        sp = (
            f", {thr['speedup_vs_single_worker']:.2f}x the single 2-thread worker's sequential {thr['single_worker_sequential_s']:.1f} s"
            if thr.get("speedup_vs_single_worker")
            else ""
        )
        out += [
            "### Throughput (B3, 2 workers)",
            "",
            (
                f"{thr['requests']} requests submitted at once to {thr['workers']} workers of {thr['threads_each']} thread: "
                f"{thr['wall_s']:.1f} s, {thr['requests_per_s']:.3f} requests/s, {thr['prompt_tokens_per_s']:.0f} prompt tokens/s{sp}. "
                "The `kvpool-2w` rows' times to first token include the wait in the queue."
            ),
            "",
        ]
    return out


def _md_hashing(run: Run) -> list[str]:
    """Chain hashing and lookup of a long prompt."""
    out: list[str] = []
    h = run.get("hashing")
    if h:
        out += [
            "### Chain hashing and lookup",
            "",
            (
                f"{h['tokens']} tokens ({h['chunks']} chunks): hashing {_ms(h['hash_p50_s'])}, index lookup {_ms(h['lookup_p50_s'])}, "
                f"together {_ms(h['total_p50_s'])} p50, {_ms(h['total_p95_s'])} p95 ({h['reps']} repetitions)."
            ),
            "",
        ]
    return out


def _md_notes(run: Run) -> list[str]:
    """Caveats of the comparison, then the targets."""
    prof = run["profile"]
    out: list[str] = []
    out += [
        "### Notes",
        "",
        (
            f"- The store holds full chunks of {prof['chunk_size']} tokens and each prompt's partial last chunk (its tail), so a "
            "worker that never saw a prompt resumes at the exact token another worker reached, as its own context would."
        ),
        (
            "- `LlamaDiskCache` (llama-cpp-python 0.3.36) removes an entry when it reads it and stores the new prompt instead, so "
            "when requests alternate between documents most of its lookups find only the other document."
        ),
        "- Both llama-cpp-python caches load a saved state even when it shares only BOS with the prompt (B4).",
        "",
        "### Targets",
        "",
        "Targets are set for the `bench` model; other models' rows are for information.",
        "",
    ]
    out += [
        _md_table(
            ["target", "goal", "measured", "result", "note"],
            [
                [
                    g["target"],
                    g["goal"],
                    g["shown"],
                    "met" if g["met"] else ("**missed**" if g["met"] is False else "n/a"),
                    g.get("note", ""),
                ]
                for g in run["targets"]
            ],
        ),
        "",
    ]
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def write_outputs(doc: dict[str, Any], out: Path) -> list[Path]:
    """Write results.json, report.md and the plots into ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    plots = plot(doc, out)
    write_json(doc, out / "results.json")
    (out / "report.md").write_text(markdown(doc, plots))
    return [out / "results.json", out / "report.md", *(out / p for p in plots)]
