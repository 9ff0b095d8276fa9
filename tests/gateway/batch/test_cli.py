"""``kvpool batch`` over real workers, real redis-server and S3 over HTTP: prefix sharing, resuming, bad lines."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis
from rq.registry import DeferredJobRegistry

from gateway.batch import Line, Parsed, Rejected, Request, ResultFile, parse_all, plan
from gateway.prepare import Prepared, Preparer
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.settings import GatewaySettings
from gateway.tenants import Tenants
from tests.helpers import MODEL, POOL_CHUNK, prompt_text
from worker.protocol import JobSpec

ROOT = Path(__file__).resolve().parents[2]
PREFIX_WORDS = (60, 75, 90, 100)
"""Four shared prefixes of about 110 to 180 tokens: three to five full chunks of 32."""


def batch_requests(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` requests over four long shared prefixes, two families of completions and two of chats."""
    prefixes = [prompt_text(100 + seed * 10 + f, words) for f, words in enumerate(PREFIX_WORDS)]
    out = []
    for i in range(n):
        f = i % len(prefixes)
        question = f"Q{i}: " + prompt_text(1000 + seed * 1000 + i, 6)
        if f < 2:
            url, body = "/v1/completions", {"model": MODEL, "prompt": prefixes[f] + " " + question, "max_tokens": 2, "temperature": 0}
        else:
            messages = [{"role": "system", "content": prefixes[f]}, {"role": "user", "content": question}]
            url, body = "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
        out.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    return out


def write_jsonl(path: Path, docs: list[Any]) -> Path:
    path.write_text("".join((d if isinstance(d, str) else json.dumps(d)) + "\n" for d in docs))
    return path


def read_results(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def batch_cmd(inp: Path, out: Path, *args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "kvpool"), "batch", str(inp), "-o", str(out), "--no-progress", *args]


def run_batch(env: dict[str, str], inp: Path, out: Path, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        batch_cmd(inp, out, *args), env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def summary_reuse(stdout: str) -> tuple[int, int, float]:
    """(reused up to the ideal, ideal, percentage) from the summary's ``reuse:`` line."""
    m = re.search(r"reuse: ([\d,]+) of ([\d,]+) tokens that whole-chunk sharing allows \(([\d.]+)%\)", stdout)
    assert m, stdout
    return int(m[1].replace(",", "")), int(m[2].replace(",", "")), float(m[3])


def ideal_bounds(requests: list[dict[str, Any]], tiny_model: Path) -> tuple[int, int]:
    """Bounds on the ideal reuse, from pairwise shared chunks within each prefix family.

    Whatever the schedule, each request after the first of its family shares with an earlier
    one at least the fewest and at most the most full chunks any two members share.
    """
    settings = GatewaySettings(model=str(tiny_model), chunk_size=POOL_CHUNK, n_ctx=2048)
    preparer = Preparer(settings, tiny_model)
    tenant = Tenants({}, "").resolve(None)
    chains: dict[int, list[list[str]]] = {}
    for i, r in enumerate(requests):
        if r["url"] == "/v1/completions":
            spec = preparer.completion(CompletionRequest.model_validate(r["body"]), tenant).spec
        else:
            spec = preparer.chat(ChatCompletionRequest.model_validate(r["body"]), tenant).spec
        chains.setdefault(i % len(PREFIX_WORDS), []).append(spec.chain)
    lo = hi = 0
    for members in chains.values():
        shared = [sum(1 for _ in itertools.takewhile(lambda kv: kv[0] == kv[1], zip(a, b))) for a, b in itertools.combinations(members, 2)]
        assert min(shared) >= 3, "each family must share at least three full chunks"
        lo += (len(members) - 1) * min(shared) * POOL_CHUNK
        hi += (len(members) - 1) * max(shared) * POOL_CHUNK
    return lo, hi


def test_200_requests_over_shared_prefixes_reuse_what_whole_chunks_allow(start_worker, pool_env, tiny_model, tmp_path) -> None:
    start_worker("w1")
    start_worker("w2")
    requests = batch_requests(200)
    inp, out = write_jsonl(tmp_path / "requests.jsonl", requests), tmp_path / "results.jsonl"

    t0 = time.monotonic()
    r = run_batch(pool_env, inp, out)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]

    results = read_results(out)
    assert sorted(x["custom_id"] for x in results) == sorted(q["custom_id"] for q in requests)
    assert all(x["error"] is None and x["response"]["status_code"] == 200 for x in results)
    assert len({x["id"] for x in results}) == 200 and all(x["id"].startswith("batch_req_") for x in results)
    by_id = {q["custom_id"]: q for q in requests}
    for x in results:
        body = x["response"]["body"]
        chat = by_id[x["custom_id"]]["url"] == "/v1/chat/completions"
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        assert body["id"].endswith(x["response"]["request_id"])
        assert body["usage"]["completion_tokens"] <= 2

    reused, ideal, pct = summary_reuse(r.stdout)
    lo, hi = ideal_bounds(requests, tiny_model)
    assert lo <= ideal <= hi, (lo, ideal, hi)
    cached = sum(x["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for x in results)
    workers = Counter(x["response"]["body"]["kvpool"]["worker"] for x in results)
    print(
        f"\nbatch of 200: {wall:.1f} s wall; reuse {reused} of ideal {ideal} ({pct}%); cached in total {cached}; per worker {dict(workers)}"
    )
    print(r.stdout)
    assert pct >= 80.0 and reused >= 0.8 * ideal
    assert cached >= 0.8 * ideal
    assert set(workers) == {"w1", "w2"}, "siblings fan out over every worker"


def test_a_batch_killed_halfway_resumes_without_repeating_a_line(start_worker, pool_env, tmp_path) -> None:
    start_worker("w1")
    start_worker("w2")
    requests = batch_requests(200, seed=1)
    inp, out = write_jsonl(tmp_path / "requests.jsonl", requests), tmp_path / "results.jsonl"

    with open(tmp_path / "first.log", "wb") as log:
        proc = subprocess.Popen(batch_cmd(inp, out), env={**os.environ, **pool_env}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while not out.exists() or out.read_bytes().count(b"\n") < 100:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the batch did not write half its lines in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    written = out.read_bytes().count(b"\n")
    assert 100 <= written < 200, "killed after roughly half the lines"

    r = run_batch(pool_env, inp, out)
    assert r.returncode == 0, r.stderr[-3000:]
    done = re.search(r"(\d+) already done", r.stdout)
    assert done and int(done[1]) >= written
    results = read_results(out)
    counts = Counter(x["custom_id"] for x in results)
    assert set(counts) == {q["custom_id"] for q in requests}
    assert all(n == 1 for n in counts.values()), [c for c, n in counts.items() if n > 1]
    assert all(x["error"] is None and x["response"]["status_code"] == 200 for x in results)

    again = run_batch(pool_env, inp, out)
    assert again.returncode == 0 and "200 already done" in again.stdout
    assert len(read_results(out)) == 200


def test_bad_lines_are_reported_by_number_and_the_rest_succeed(start_worker, pool_env, tmp_path) -> None:
    start_worker("w1")
    ok = {"model": MODEL, "prompt": prompt_text(40, 50), "max_tokens": 2, "temperature": 0}
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": ok},
        '{"custom_id": "b", "method": "POST", ',
        {"method": "POST", "url": "/v1/completions", "body": ok},
        {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": ok},
        {"custom_id": "d", "method": "GET", "url": "/v1/completions", "body": ok},
        {"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": {**ok, "temperature": 5}},
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": ok},
        {"custom_id": "f", "method": "POST", "url": "/v1/completions", "body": {**ok, "model": "no-such-model"}},
        {
            "custom_id": "g",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        },
        "",
        {"custom_id": "h", "method": "POST", "url": "/v1/completions", "body": {**ok, "prompt": ok["prompt"] + " more"}},
        {"custom_id": "i", "url": "/v1/completions", "body": ok},
    ]
    inp, out = write_jsonl(tmp_path / "requests.jsonl", lines), tmp_path / "results.jsonl"
    r = run_batch(pool_env, inp, out)
    assert r.returncode == 0, r.stderr[-3000:]
    for n in (2, 3, 4, 5, 6, 7, 8, 12):
        assert re.search(rf"^rejected line {n}: ", r.stderr, re.MULTILINE), (n, r.stderr)
    assert not re.search(r"line (1|9|10|11): ", r.stderr)

    results = read_results(out)
    assert len(results) == 11
    answered = {x["custom_id"] for x in results if x["response"] and x["response"]["status_code"] == 200}
    assert answered == {"a", "g", "h"}
    errors = {x["error"]["message"].split(":")[0]: x for x in results if x["error"]}
    assert set(errors) == {"line 2", "line 3", "line 4", "line 5", "line 7", "line 12"}
    assert errors["line 2"]["error"]["code"] == "invalid_json" and errors["line 2"]["custom_id"] is None
    assert errors["line 4"]["error"]["code"] == "invalid_url" and errors["line 4"]["custom_id"] == "c"
    assert errors["line 5"]["error"]["code"] == "invalid_method"
    assert errors["line 7"]["error"]["code"] == "duplicate_custom_id" and "first on line 1" in errors["line 7"]["error"]["message"]
    assert errors["line 7"]["custom_id"] is None
    assert errors["line 12"]["error"]["code"] == "missing_field"
    statuses = {x["custom_id"]: x["response"] for x in results if x["response"] and x["response"]["status_code"] != 200}
    assert statuses["e"]["status_code"] == 400 and statuses["e"]["body"]["error"]["param"] == "temperature"
    assert statuses["e"]["body"]["error"]["message"].startswith("temperature: "), "as the HTTP API words it (test_errors.py)"
    assert re.search(r"^rejected line 6: temperature: ", r.stderr, re.MULTILINE)
    assert statuses["f"]["status_code"] == 404 and statuses["f"]["body"]["error"]["code"] == "model_not_found"

    again = run_batch(pool_env, inp, out)
    assert again.returncode == 0 and "11 already done" in again.stdout and "rejected line" not in again.stderr
    assert len(read_results(out)) == 11


def test_no_live_worker_is_a_clear_error_and_no_hang(pool_env, tmp_path) -> None:
    inp = write_jsonl(tmp_path / "requests.jsonl", batch_requests(4))
    out = tmp_path / "results.jsonl"
    r = run_batch(pool_env, inp, out, timeout_s=60)  # a hang fails here
    assert r.returncode != 0
    assert "no live worker" in r.stderr
    assert not out.exists()


def test_losing_every_worker_ends_the_batch_and_a_rerun_finishes_it(start_worker, pool_env, tmp_path) -> None:
    worker = start_worker("w1")
    requests = batch_requests(60, seed=2)
    inp, out = write_jsonl(tmp_path / "requests.jsonl", requests), tmp_path / "results.jsonl"
    with open(tmp_path / "first.log", "wb") as log:
        proc = subprocess.Popen(
            batch_cmd(inp, out, "--worker-grace", "1"), env={**os.environ, **pool_env}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 120
        while not out.exists() or out.read_bytes().count(b"\n") < 10:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.02)
        worker.kill()
        rc = proc.wait(timeout=60)  # the advert expires within its TTL, then the grace: a hang fails here
    first = (tmp_path / "first.log").read_text()
    assert rc == 1 and "no live worker for 1 s" in first, first[-3000:]
    assert len(read_results(out)) < 60

    start_worker("w2")
    r = run_batch(pool_env, inp, out)
    assert r.returncode == 0, r.stderr[-3000:]
    results = read_results(out)
    assert Counter(x["custom_id"] for x in results) == Counter(q["custom_id"] for q in requests)
    assert all(x["response"]["status_code"] == 200 for x in results)


def test_a_failed_leader_hands_its_group_to_the_next_member(start_worker, pool_env, redis_url, tmp_path) -> None:
    """The worker rejects prompts longer than its context: every leader fails, so its deferred siblings
    (which RQ would never release) are withdrawn and the next member leads, until every line is answered."""
    start_worker("w1", KVPOOL_N_CTX="64")
    requests = batch_requests(12, seed=3)[::2]
    inp, out = write_jsonl(tmp_path / "requests.jsonl", requests), tmp_path / "results.jsonl"
    r = run_batch(pool_env, inp, out, timeout_s=120)
    assert r.returncode == 0, r.stderr[-3000:]
    results = read_results(out)
    assert sorted(x["custom_id"] for x in results) == sorted(q["custom_id"] for q in requests)
    for x in results:
        assert x["response"]["status_code"] == 502
        assert "does not fit the context of 64" in x["response"]["body"]["error"]["message"]
    assert re.search(r"leader_promoted withdrawn=[1-9]", r.stderr), "siblings were waiting on the failed leader"
    conn = redis.Redis.from_url(redis_url)
    assert DeferredJobRegistry("kvpool", connection=conn).count == 0


# -- planning and the output file, without processes ------------------------------------------


def _request(line: int, chain: list[str], n_tokens: int) -> Request:
    spec = JobSpec(tokens=[5] * n_tokens, chain=chain, chunk_size=POOL_CHUNK, model="m", enqueued_at=0.0)
    return Request(line, f"r{line}", Prepared(spec, False), False)


def test_plan_groups_by_first_chunk_and_leads_with_the_member_sharing_most() -> None:
    reqs = [
        _request(1, ["a", "b"], 70),
        _request(2, ["a", "b", "c", "d"], 140),
        _request(3, ["a", "b", "c", "e"], 140),
        _request(4, ["a", "x"], 80),
        _request(5, ["z"], 40),
        _request(6, [], 10),
        _request(7, ["a", "b", "c", "d"], 128),
    ]
    groups = plan(reqs, POOL_CHUNK)
    assert [g.leader.line for g in groups] == [2, 5, 6]
    assert [r.line for r in groups[0].siblings] == [1, 3, 4, 7]
    assert all(not g.siblings for g in groups[1:])
    ideal = {r.line: r.ideal for r in reqs}
    assert ideal == {2: 0, 1: 64, 3: 96, 4: 32, 7: 127, 5: 0, 6: 0}


def test_parse_all_numbers_lines_and_rejects_duplicates() -> None:
    good = json.dumps({"custom_id": "x", "method": "post", "url": "/v1/completions", "body": {}})
    entries = parse_all([Line(1, good), Line(3, "[1]"), Line(4, good)])
    assert isinstance(entries[0], Parsed) and entries[0].custom_id == "x"
    assert isinstance(entries[1], Rejected) and entries[1].code == "invalid_json" and entries[1].report().startswith("line 3: ")
    assert isinstance(entries[2], Rejected) and entries[2].code == "duplicate_custom_id"
    assert entries[2].result_id != entries[1].result_id


def test_result_file_drops_a_line_cut_short_and_appends_after_it(tmp_path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text(json.dumps({"id": "batch_req_1", "custom_id": "a"}) + "\n" + '{"id": "batch_req_2", "cust')
    f = ResultFile(path).load()
    assert f.done == {"batch_req_1"}
    f.write({"id": "batch_req_2", "custom_id": "b", "response": None, "error": None})
    f.close()
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["batch_req_1", "batch_req_2"]
