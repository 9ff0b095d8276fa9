"""``kvpool bench``: the quick run end to end (real services, workers and outputs; no timing assertions), and its pure parts."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import llama_cpp
import pytest
from click.testing import CliRunner

from gateway.pool.bench.cli import bench_command
from gateway.pool.bench.peer_workloads import workloads
from gateway.pool.bench.peers import template_stops
from gateway.pool.bench.plan import PROFILES, cold_subset
from gateway.pool.bench.systems import Sample
from gateway.pool.bench.workloads import TokenSource, build
from gateway.pool.procs import kvpool_command

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def quick_results(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "kvpool"), "bench", "--quick", "--out", str(out), "--models-dir", str(tiny_model.parent)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.timeout(180)
def test_quick_run_writes_every_output_and_field(quick_results: tuple[Path, str]) -> None:
    out, stdout = quick_results
    assert "Expected duration" in stdout and "[  1/" in stdout
    doc = json.loads((out / "results.json").read_text())
    assert {"version", "command", "started_at", "duration_s", "machine", "store", "store_endpoint", "runs"} <= doc.keys()
    assert doc["command"].startswith("kvpool bench --quick")
    assert {"cpu", "usable_cpus", "memory_gb", "platform", "llama_cpp_python", "loadavg_at_start", "loadavg_at_end"} <= doc[
        "machine"
    ].keys()
    (run,) = doc["runs"]
    assert run["model"]["label"] == "tiny"
    for key in ("samples", "summary", "floor", "miss_cost", "throughput", "bytes_per_token", "hashing", "raw_get", "targets"):
        assert run[key], key

    names = {f.name for f in fields(Sample)}
    assert all(names == s.keys() for s in run["samples"])
    pairs = {(s["workload"], s["system"]) for s in run["samples"]}
    base = {"cold", "llama-ram", "llama-disk", "kvpool", "kvpool-cross"}
    expected = {(w, s) for w in ("shared", "chat", "docs", "unique") for s in base}
    expected |= {("shared", "suffix-only"), ("docs", "kvpool-2w"), ("unique", "kvpool-nostore")}
    assert pairs == expected
    for row in run["summary"]:
        assert {"ttft_p50_s", "ttft_p95_s", "total_s", "evaluated_tokens", "reused_tokens", "speedup_vs_cold"} <= row.keys()
        assert row["ttft_p50_s"] > 0 and row["evaluated_tokens"] + row["reused_tokens"] == row["prompt_tokens"]
    assert len(run["targets"]) == 9 and all({"target", "goal", "measured", "met"} <= t.keys() for t in run["targets"])
    assert {"floor_s", "ratio", "raw_get_bytes_per_s", "kv_bytes", "suffix_eval_s"} <= run["floor"].keys()


def test_cross_worker_requests_are_served_from_the_store_alone(quick_results: tuple[Path, str]) -> None:
    run = json.loads((quick_results[0] / "results.json").read_text())["runs"][0]
    cross = [s for s in run["samples"] if s["system"] == "kvpool-cross"]
    assert cross and all(s["cached_from_context"] == 0 for s in cross)
    shared = [s for s in cross if s["workload"] == "shared"]
    assert all(s["cached_from_store"] == run["profile"]["sizes"]["prefix_tokens"] for s in shared)
    assert {s["worker"] for s in shared} == {"bench-tiny-cross-a", "bench-tiny-cross-b"}


def test_quick_run_writes_the_report_and_plots(quick_results: tuple[Path, str]) -> None:
    out, stdout = quick_results
    report = (out / "report.md").read_text()
    assert "kvpool bench --quick" in report and "### Targets" in report and "![ttft.png](ttft.png)" in report
    for png in ("ttft.png", "tokens.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "targets" in stdout and "B1 shared prefix" in stdout


def test_workloads_are_deterministic_and_sized_as_asked(tiny_model: Path) -> None:
    llm = llama_cpp.Llama(str(tiny_model), vocab_only=True, verbose=False)
    sizes = PROFILES["quick"].sizes
    a = build(("shared", "chat", "docs", "unique"), TokenSource(llm), sizes, seed=3)
    b = build(("shared", "chat", "docs", "unique"), TokenSource(llm), sizes, seed=3)
    assert [[r.tokens for r in w.requests] for w in a] == [[r.tokens for r in w.requests] for w in b]
    shared, chat, docs, unique = a
    assert [r.n for r in shared.requests] == [sizes.prefix_tokens + sizes.question_tokens] * (sizes.shared_questions + 1)
    assert [r.warmup for r in shared.requests] == [True] + [False] * sizes.shared_questions
    assert all(r.tokens[: sizes.prefix_tokens] == shared.requests[0].tokens[: sizes.prefix_tokens] for r in shared.requests)
    assert len(chat.requests) == sizes.chat_turns
    assert all(nxt.tokens[: len(cur.tokens)] == cur.tokens for cur, nxt in zip(chat.requests, chat.requests[1:]))
    assert len(docs.requests) == sizes.docs * sizes.doc_questions
    assert len({tuple(r.tokens[:8]) for r in unique.requests}) == sizes.unique_prompts
    c = build(("shared",), TokenSource(llm), sizes, seed=4)
    assert c[0].requests[1].tokens != shared.requests[1].tokens


def test_cold_subset_spreads_over_the_workload(tiny_model: Path) -> None:
    llm = llama_cpp.Llama(str(tiny_model), vocab_only=True, verbose=False)
    (chat,) = build(("chat",), TokenSource(llm), PROFILES["tiny"].sizes)
    assert cold_subset(chat, 3) == {0, 3, 5}
    assert cold_subset(chat, None) == set(range(6))


def test_bad_workload_names_are_refused() -> None:
    result = CliRunner().invoke(bench_command, ["--workloads", "shared,nope"])
    assert result.exit_code == 2 and "--workloads" in result.output


def test_the_report_can_be_rewritten_from_its_json(quick_results: tuple[Path, str], tmp_path: Path) -> None:
    out, _ = quick_results
    result = CliRunner().invoke(bench_command, ["--from-json", str(out / "results.json"), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report.md").read_text() == (out / "report.md").read_text()
    assert (tmp_path / "ttft.png").exists() and (tmp_path / "tokens.png").exists()


def test_bench_peers_rewrites_its_report_and_plot_from_json(tmp_path: Path) -> None:
    """The report judges each target from the runs; a missing peer leaves its targets out rather than guessing."""
    from gateway.pool.bench.cli import bench_peers_command

    def run(system: str, workload: str, conc: int, wall: float, ttft: float) -> dict[str, object]:
        return {
            "system": system,
            "workload": workload,
            "concurrency": conc,
            "wall_s": wall,
            "ttft_s": [ttft],
            "ttft_p50": ttft,
            "ttft_p95": ttft,
            "prompt_tokens": 100,
            "cached_tokens": 50,
            "completion_tokens": 32,
            "answers": ["a"],
        }

    doc = {
        "model": "m",
        "threads": 2,
        "n_ctx": 4096,
        "command": "kvpool bench-peers --model m.gguf",
        "runs": [run("llama-server 1 slot", "W1", 1, 10.0, 0.2), run("kvpool 1w x 2t", "W1", 1, 10.4, 0.1)],
        "decode": [{"system": "llama-server 1 slot", "wall_s": 1.0, "completion_tokens": 100, "tokens_per_s": 100.0}],
    }
    src = tmp_path / "in.json"
    src.write_text(json.dumps(doc))
    out = tmp_path / "out"
    result = CliRunner().invoke(bench_peers_command, ["--from-json", str(src), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "peers.md").read_text()
    assert "Command: `kvpool bench-peers --model m.gguf`" in md
    assert (
        "| W1 c=1: kvpool 1 worker within 1.05x of llama-server 1 slot (wall and TTFT p50) | kvpool's time over llama-server's: wall 1.04x"
        in md
    )
    assert "| met |" in md and "2 round-robin" not in md.split("### Targets")[1] and "decode: kvpool" not in md
    assert (out / "peers.png").stat().st_size > 0 and "![peers.png](peers.png)" in md


def test_bench_peers_reports_each_run_beside_its_repeat_with_a_busy_neighbour(tmp_path: Path) -> None:
    from gateway.pool.bench.peers_report import report

    def run(system: str, wall: float, neighbour: bool) -> dict[str, object]:
        return {"system": system, "workload": "W4", "concurrency": 1, "wall_s": wall, "ttft_s": [1.0, 1.0], "neighbour": neighbour}

    runs = [run("llama-server 1 slot", 6.0, False), run("llama-server 1 slot", 14.0, True)]
    runs += [run("kvpool 1w x 2t", 7.0, False), run("kvpool 1w x 2t", 112.0, True)]
    for r in runs:
        r.update(ttft_p50=1.0, ttft_p95=1.0, prompt_tokens=10, cached_tokens=0, completion_tokens=4, answers=["a", "b"])
    md = report({"model": "m", "threads": 2, "n_ctx": 4096, "runs": runs, "decode": []}, "kvpool bench-peers --neighbour")
    assert "| kvpool 1w x 2t | W4 | 1 | 3.50 | 56.00 | 16.00x | 1000 / 1000 | 8.00x |" in md
    assert (
        "a busy neighbour on one core: kvpool 1 worker within 1.3x of llama-server 1 slot | kvpool's time over llama-server's: 8.00x" in md
    )
    assert "wall 1.17x (7.0 vs 6.0 s)" in md  # the usual tables and targets compare the runs without the neighbour
    assert "### decode" not in md


def test_bench_peers_runs_the_systems_asked_for_in_their_usual_order(tmp_path: Path) -> None:
    from gateway.pool.bench.peers import systems

    binary, model = tmp_path / "llama-server", tmp_path / "m.gguf"
    chosen = systems(binary, model, threads=2, n_ctx=4096, logs=tmp_path, only=("kvpool-2w", "server-1"))
    assert list(chosen) == ["llama-server 1 slot", "kvpool 2w x 1t"]
    assert list(systems(None, model, threads=2, n_ctx=4096, logs=tmp_path, only=("server-1", "kvpool-1w"))) == ["kvpool 1w x 2t"]
    assert list(systems(None, model, threads=2, n_ctx=4096, logs=tmp_path, only=("kvpool-1w", "kvpool"))) == [
        "kvpool 1w x 2t, defaults",
        "kvpool 1w x 2t",
    ]


def test_bench_peers_refuses_a_system_it_does_not_know(tmp_path: Path) -> None:
    from gateway.pool.bench.cli import bench_peers_command

    result = CliRunner().invoke(bench_peers_command, ["--systems", "kvpool-1w,vllm", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "--systems" in result.output and "server-1, server-4, round-robin, kvpool, kvpool-1w, kvpool-1w4s, kvpool-2w" in result.output


def test_stored_bytes_per_chunk_leave_tails_out(index) -> None:
    """A tail holds fewer tokens than a chunk: counted in, it would make a chunk look smaller than it is."""
    from gateway.pool.bench.measure import stored_bytes
    from store.chain import Namespace

    ns, other = Namespace("model-a", chunk_size=4), Namespace("model-b", chunk_size=4)
    index.add(b"a" * 16, ns.key, 0, 1000)
    index.add(b"b" * 16, ns.key, 1, 1000)
    index.add(b"c" * 16, other.key, 0, 7)
    index.add_tail(b"t" * 16, ns.key, 2, b"b" * 16, b"\0" * 8, 300, cap=4)
    assert sorted(stored_bytes(index, ns)) == [1000, 1000]


def test_bench_peers_judges_one_worker_at_default_settings_against_both_llama_server_configurations() -> None:
    """The defaults' worker must match 4 slots at 4 clients and 1 slot's time at one; the 1-sequence worker's targets stay its own."""
    from gateway.pool.bench.peers_report import report

    def run(system: str, conc: int, wall: float) -> dict[str, object]:
        return {"system": system, "workload": "W2", "concurrency": conc, "wall_s": wall, "ttft_s": [1.0]}

    runs = [run("llama-server 1 slot", 1, 10.0), run("llama-server 4 slots", 4, 8.0)]
    runs += [run("kvpool 1w x 2t, defaults", 1, 10.5), run("kvpool 1w x 2t, defaults", 4, 6.4), run("kvpool 1w x 2t", 1, 9.0)]
    for r in runs:
        r.update(ttft_p50=1.0, ttft_p95=1.0, prompt_tokens=10, cached_tokens=0, completion_tokens=4, answers=["a"])
    decode = [
        {"system": "llama-server 4 slots", "wall_s": 1.0, "completion_tokens": 100, "tokens_per_s": 100.0},
        {"system": "kvpool 1w x 2t, defaults", "wall_s": 1.0, "completion_tokens": 100, "tokens_per_s": 90.0},
    ]
    md = report({"model": "m", "threads": 2, "n_ctx": 4096, "runs": runs, "decode": decode}, "kvpool bench-peers")
    targets = md.split("### Targets")[1]
    assert (
        "| W2 c=4: kvpool 1 worker at default settings at least as fast as llama-server 4 slots | 1.25x as fast (6.4 vs 8.0 s) | met |"
        in targets
    )
    assert (
        "| W2 c=1: kvpool 1 worker at default settings within 1.0x of llama-server 1 slot's time | kvpool's time over llama-server's: 1.05x"
        in targets
    )
    assert "1.05x (10.5 vs 10.0 s) | **missed** |" in targets
    assert "at least llama-server 4 slots' tokens/s | 0.90x (90 vs 100 tokens/s) | **missed** |" in targets
    assert (
        "kvpool 1 worker within 1.05x of llama-server 1 slot (wall and TTFT p50) | kvpool's time over llama-server's: wall 0.90x" in targets
    )


def test_the_committed_peers_report_is_what_its_recorded_json_gives(tmp_path: Path) -> None:
    """docs/bench/peers.md, targets and verdicts included, is exactly the report of docs/bench/peers.json: nothing edited by hand but its superseded mark."""
    from gateway.pool.bench.cli import bench_peers_command

    docs = Path(__file__).resolve().parents[3] / "docs" / "bench"
    result = CliRunner().invoke(bench_peers_command, ["--from-json", str(docs / "peers.json"), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    md = (tmp_path / "peers.md").read_text()
    mark, _, committed = (docs / "peers.md").read_text().partition("\n\n")
    assert mark.startswith("> Superseded by [") and md == committed  # only the superseded mark is added by hand
    assert "### Targets" in md and "| met |" in md and "missed" in md  # the recorded run met some targets and missed others


def test_bench_decode_measures_each_count_in_a_process_of_its_own_and_reports_exact_answers(smollm2: Path, tmp_path: Path) -> None:
    """Each sequence count runs as a worker would, on one computing thread of a fresh process: the answers are those
    decoded alone, and the JSON says which mode the check chose."""
    out = tmp_path / "decode.json"
    args = ["--model", str(smollm2), "--sequences", "1,2", "--tokens", "6", "--out", str(out)]
    done = subprocess.run(kvpool_command("bench-decode", *args), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| 2 |" in done.stdout, done.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["sequences"] for r in runs] == [1, 2]
    assert [r["same_as_alone"] for r in runs] == [1, 2], "every sequence's answer is what it decodes alone"
    assert all(r["decode_mode"] in ("single", "pair") and r["tokens_per_s"] > 0 for r in runs)


def test_bench_overhead_reports_the_worker_and_the_rest_of_each_request_through_a_real_pool(tiny_model: Path, tmp_path: Path) -> None:
    """Every request crosses a real gateway, Redis and worker; the worker's own time and the queue wait it reports fit
    inside the client's wall time, and the first request (which fills the context) is left out of the summary."""
    out = tmp_path / "overhead.json"
    args = ["--model", str(tiny_model), "--sequences", "1", "--requests", "4", "--out", str(out)]
    done = subprocess.run(kvpool_command("bench-overhead", *args), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| 1 | 3 |" in done.stdout, done.stdout
    report = json.loads(out.read_text())
    samples = report["samples"]["1"]
    assert len(samples) == 4
    assert all(s["worker_s"] > 0 and s["queue_wait_s"] > 0 and s["worker_s"] + s["queue_wait_s"] < s["wall_s"] for s in samples)
    (run,) = report["runs"]
    assert run["parallel"] == 1 and run["requests"] == 3
    assert run["outside_p50_ms"] >= run["queue_wait_p50_ms"] > 0


def test_the_hosts_probe_publishes_once_then_restores_and_chooses_at_each_rate(
    pool_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`deploy/hosts-check.sh`'s probe over a real Redis and S3 (no link shaping here): one JSON line per rate, each
    restoring what the one publish stored, with the cold run's first token."""
    from gateway.pool.bench.hosts import main as hosts_probe

    for key, value in pool_env.items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(hosts_probe, ["--model", pool_env["KVPOOL_MODEL"], "--lengths", "600", "--rate", "a", "--rate", "b"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert [line["rate"] for line in lines] == ["a", "b"]
    for line in lines:
        assert line["same_first_token"], line
        assert line["cold"]["evaluated"] == 600
        assert line["restore"]["cached_store"] >= 512, "every whole chunk of the published prompt restored"


def test_bench_peers_asks_both_systems_to_stop_at_the_chat_templates_end_of_turn(gemma3: Path, smollm2: Path) -> None:
    """Gemma 3's GGUF has no template, so both servers render ChatML, whose ``<|im_end|>`` is ordinary text to Gemma:
    every request of every workload asks both to stop there, so their answers end alike (for SmolLM2 it is its end of generation).
    """
    assert template_stops(gemma3) == template_stops(smollm2) == ("<|im_end|>",)
    found = workloads(Path(__file__).resolve().parents[3], "gemma", stop=template_stops(gemma3))
    bodies = [json.loads(b) for w in found for b in w.bodies] + [json.loads(c.body([])) for w in found for c in w.chats]
    assert len(bodies) == 12 + 20 + 8 + 5 and all(b["stop"] == ["<|im_end|>"] for b in bodies)
    assert "stop" not in json.loads(workloads(Path(__file__).resolve().parents[3], "m", ("W4",))[0].bodies[0]), "none unless asked"
