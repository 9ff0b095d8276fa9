"""The OpenAI Batch API over HTTP, through the official client: files, batches, results, cancel, tenants, restarts.

A real pool (redis-server, S3 over HTTP, a worker, gateway processes): a batch uploaded
with ``client.files.create`` and started with ``client.batches.create`` runs to
``completed``, with ``request_counts``, an output file and an error file for the bad
lines. One tenant never sees another's files or batches. A gateway killed in the middle
of a batch loses nothing: the next gateway resumes it and answers what is missing.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time

import httpx
import openai
import pytest
import redis

from gateway.batch.records import BATCH_PREFIX
from gateway.pool.procs import free_port
from tests.helpers import MODEL, openai_client, prompt_text

KEYS = json.dumps({"key-a": "team-a", "key-b": "team-b"})


def _lines(n: int, *, bad: int = 0) -> bytes:
    out = []
    for i in range(n):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt_text(500 + i % 2, 40) + f" Q{i}"}],
            "max_tokens": 3,
            "temperature": 0,
        }
        out.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    for i in range(bad):
        out.append(
            {"custom_id": f"bad-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {"model": MODEL, "messages": "not a list"}}
        )
    return "".join(json.dumps(x) + "\n" for x in out).encode()


def _wait(client: openai.OpenAI, batch_id: str, until: tuple[str, ...], timeout_s: float = 180) -> openai.types.Batch:
    deadline = time.monotonic() + timeout_s
    while (b := client.batches.retrieve(batch_id)).status not in until:
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.2)
    return b


def test_a_batch_runs_to_completed_with_an_output_and_an_error_file(start_worker, start_gateway) -> None:
    start_worker("w1")
    client = openai_client(start_gateway())
    f = client.files.create(file=("requests.jsonl", io.BytesIO(_lines(6, bad=2))), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "t1"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "t1"}
    done = _wait(client, batch.id, ("completed", "failed"))
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 6, 2)
    results = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in results) == [f"req-{i}" for i in range(6)]
    assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["choices"][0]["message"]["content"] for r in results)
    assert any(r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in results), (
        "prefix-aware: shared prefixes hit"
    )
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in errors) == ["bad-0", "bad-1"] and all(r["response"]["status_code"] == 400 for r in errors)
    listed = client.batches.list(limit=5)
    assert [b.id for b in listed.data] == [batch.id]


def test_one_tenant_never_sees_another_tenants_files_or_batches(start_worker, start_gateway) -> None:
    start_worker("w1")
    gw = start_gateway(KVPOOL_API_KEYS=KEYS)
    a, b = openai_client(gw, "key-a"), openai_client(gw, "key-b")
    f = a.files.create(file=("a.jsonl", io.BytesIO(_lines(1))), purpose="batch")
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (
        lambda: b.files.retrieve(f.id),
        lambda: b.files.content(f.id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError):
        b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.batches.list().data == []
    assert _wait(a, batch.id, ("completed",)).request_counts.completed == 1


@pytest.mark.parametrize(
    ("data", "purpose", "needle"),
    [
        (b'{"custom_id": 1}\nnot json\n', "batch", "line 2 is not JSON"),
        (b"[1, 2]\n", "batch", "not an object"),
        (b"\xff\xfe", "batch", "not UTF-8"),
        (b"\n\n", "batch", "no request"),
        (b"{}\n", "fine-tune", "purpose"),
    ],
)
def test_files_that_are_not_batch_jsonl_are_refused_by_name(start_worker, start_gateway, data: bytes, purpose: str, needle: str) -> None:
    start_worker("w1")
    gw = start_gateway()
    r = httpx.post(f"{gw.url}/v1/files", files={"file": ("x.jsonl", data)}, data={"purpose": purpose}, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_files_while_the_store_is_away_are_503_with_retry_after(start_gateway) -> None:
    gw = start_gateway(KVPOOL_S3_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    r = httpx.post(f"{gw.url}/v1/files", files={"file": ("x.jsonl", _lines(1))}, data={"purpose": "batch"}, timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    assert r.json()["error"]["code"] == "store_unavailable" and "store is unreachable" in r.json()["error"]["message"]
    assert httpx.get(f"{gw.url}/v1/files/file-{'0' * 24}", timeout=60).json()["error"]["code"] == "store_unavailable"


def test_bad_batch_requests_get_400_or_404_never_500(start_worker, start_gateway) -> None:
    start_worker("w1")
    gw = start_gateway(KVPOOL_BATCH_MAX_REQUESTS="3", KVPOOL_MAX_FILE_BYTES="2048")
    client = openai_client(gw)
    f = client.files.create(file=("r.jsonl", io.BytesIO(_lines(1))), purpose="batch")
    cases = [
        ({"input_file_id": f.id, "endpoint": "/v1/embeddings", "completion_window": "24h"}, 400),
        ({"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "1h"}, 400),
        ({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"}, 404),
        ({"input_file_id": 5, "endpoint": "/v1/chat/completions", "completion_window": "24h"}, 400),
        ({"endpoint": "/v1/chat/completions"}, 400),
    ]
    for body, status in cases:
        assert httpx.post(f"{gw.url}/v1/batches", json=body, timeout=30).status_code == status, body
    assert httpx.get(f"{gw.url}/v1/batches/batch_nope", timeout=30).status_code == 404
    too_many = httpx.post(f"{gw.url}/v1/files", files={"file": ("x.jsonl", _lines(4)[:2000])}, data={"purpose": "batch"}, timeout=30)
    assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "batch_too_large"
    too_big = httpx.post(f"{gw.url}/v1/files", files={"file": ("x.jsonl", b"{}\n" * 1000)}, data={"purpose": "batch"}, timeout=30)
    assert too_big.status_code == 413


def test_a_cancelled_batch_stops_and_keeps_what_was_answered(start_worker, start_gateway) -> None:
    start_worker("w1")
    client = openai_client(start_gateway())
    f = client.files.create(file=("r.jsonl", io.BytesIO(_lines(40))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    _wait(client, batch.id, ("in_progress", "completed"))
    assert client.batches.cancel(batch.id).status in ("cancelling", "completed")
    done = _wait(client, batch.id, ("cancelled", "completed"))
    counts = done.request_counts
    assert counts.completed + counts.failed <= 40 and done.cancelled_at or done.status == "completed"


def test_a_gateway_killed_mid_batch_loses_nothing(start_worker, start_gateway) -> None:
    start_worker("w1")
    first = start_gateway(KVPOOL_BATCH_LEASE_S="2")
    client = openai_client(first)
    f = client.files.create(file=("r.jsonl", io.BytesIO(_lines(30))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 3:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    second = openai_client(start_gateway(KVPOOL_BATCH_LEASE_S="2"))
    done = _wait(second, batch.id, ("completed",))
    assert (done.request_counts.total, done.request_counts.completed) == (30, 30)
    ids = [json.loads(x)["custom_id"] for x in second.files.content(done.output_file_id).text.splitlines()]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(30)), "every line answered once"


def test_a_gateway_whose_lease_went_to_another_stops_running_the_batch(start_worker, start_gateway, redis_url) -> None:
    """The lease changes hands under a running gateway (as when it stalled past its lease): it must stop at once
    rather than answer lines beside the new holder, and resume the batch once the lease is free again."""
    start_worker("w1")
    gw = start_gateway(KVPOOL_BATCH_LEASE_S="2")
    client = openai_client(gw)
    n = 300  # long enough that it cannot finish between the third answer and the lease's change of hands (30 took 1 s)
    f = client.files.create(file=("r.jsonl", io.BytesIO(_lines(n))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 3:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    conn, key = redis.Redis.from_url(redis_url), BATCH_PREFIX + batch.id + ":runner"
    assert conn.get(key).startswith(b"gateway-")
    conn.set(key, "gateway-elsewhere", px=3000)  # another gateway holds it now, for 3 s
    deadline = time.monotonic() + 60  # from the lease's change of hands, not from the batch's start
    while "batch.paused" not in gw.log():
        assert time.monotonic() < deadline, "the gateway went on running a batch whose lease it lost"
        time.sleep(0.1)
    assert "batch.lease_lost" in gw.log()
    done = _wait(client, batch.id, ("completed",))
    assert (done.request_counts.total, done.request_counts.completed) == (n, n)
    ids = [json.loads(x)["custom_id"] for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(n)), "every line answered once"
