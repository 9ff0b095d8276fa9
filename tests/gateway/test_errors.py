"""Bad input and bad days: every failure is a clear OpenAI-style error, nothing hangs, no worker crashes."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator

import anyio
import httpx
import openai
import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rq.job import Job

from gateway.pool.procs import GatewayProcess, WorkerProcess
from tests.helpers import MODEL, openai_client, poll, private_pool, prompt_text
from worker.advert import adverts

CHAT = "/v1/chat/completions"
SAME_IN_A_BATCH = [
    ("content is a number", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 3}]}),
    ("a role that does not exist", CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
    ("lone surrogate", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "a \udfff b"}]}),
    ("no model", CHAT, {"messages": [{"role": "user", "content": "x"}]}),
    ("a role the template refuses", CHAT, {"model": MODEL, "messages": [{"role": "system", "content": "x"}]}),
    (
        "a schema the grammar cannot enforce",
        CHAT,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 0}, "strict": True},
            },
        },
    ),
    ("temperature 7", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 7}),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}),
    ("a prompt that fills the context", "/v1/completions", {"model": MODEL, "prompt": "hi there " * 1500, "max_tokens": 5}),
]
"""Bad bodies and what refuses each: pydantic, the chat template, the schema check, the model check, the context check."""
NO_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('this template takes no system message') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)

LONG = {"logit_bias": {"2": -100}, "max_tokens": 1900, "temperature": 0}


def assert_openai_error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    for n in needles:
        assert n in err["message"], err["message"]
    return err


@pytest.fixture(scope="module")
def one_worker(s3_server, tiny_model, tmp_path_factory) -> Iterator[tuple[WorkerProcess, GatewayProcess]]:
    """One tiny worker and a gateway for the tests that only send requests, shared by the module."""
    with private_pool(s3_server, tiny_model, tmp_path_factory.mktemp("errors"), ["w1"]) as pool:
        yield pool.workers["w1"], pool.gateway


BAD = [
    ("not json", b"{not json", 400, ["not valid JSON"]),
    ("prompt is a number", {"model": MODEL, "prompt": 5}, 400, ["prompt"]),
    ("max_tokens is text", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, ["max_tokens"]),
    ("negative max_tokens", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, ["max_tokens"]),
    ("n=17", {"model": MODEL, "prompt": "hi", "n": 17}, 400, ["n"]),
    ("n=0", {"model": MODEL, "prompt": "hi", "n": 0}, 400, ["n"]),
    ("no model", {"prompt": "hi"}, 400, ["model"]),
    ("unknown model", {"model": "gpt-9", "prompt": "hi"}, 404, ["gpt-9"]),
    ("empty prompt", {"model": MODEL, "prompt": ""}, 400, ["empty"]),
    ("33 prompts", {"model": MODEL, "prompt": ["a"] * 33}, 400, ["at most 32 prompts"]),
    ("an empty prompt among several", {"model": MODEL, "prompt": ["a", ""]}, 400, ["prompt 1 is empty"]),
    ("a bad token among several prompts", {"model": MODEL, "prompt": [[1, 2], [1, 999999]]}, 400, ["prompt.1", "999999"]),
    ("echo with logprobs, streamed", {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, 400, ["echo"]),
    ("five stops", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, ["stop"]),
    ("token id out of range", {"model": MODEL, "prompt": [1, 999999]}, 400, ["999999"]),
    ("bad logit_bias", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, 400, ["logit_bias"]),
    ("temperature 7", {"model": MODEL, "prompt": "hi", "temperature": 7}, 400, ["temperature"]),
    ("a prompt that fills the context", {"model": MODEL, "prompt": "hi there " * 1500, "max_tokens": 5}, 400, ["2048", "prompt"]),
    ("body is a list", [1, 2], 400, []),
    ("lone surrogate in the prompt", b'{"model": "%s", "prompt": "hi \\ud800 there"}' % MODEL.encode(), 400, ["prompt", "surrogate"]),
    ("stream is text", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, ["stream"]),
    ("max_tokens is a numeric string", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, ["max_tokens"]),
    (
        "include_usage is a number",
        {"model": MODEL, "prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}},
        400,
        ["include_usage"],
    ),
]


@pytest.mark.parametrize("body,status,needles", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_completion_requests(one_worker, body, status: int, needles: list[str]) -> None:
    _, gw = one_worker
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(gw.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
    err = assert_openai_error(r, status, *needles)
    if "context" in err["message"]:
        assert err["code"] == "context_length_exceeded"


def test_bad_chat_requests(one_worker) -> None:
    _, gw = one_worker
    url = gw.url + "/v1/chat/completions"
    assert_openai_error(httpx.post(url, json={"model": MODEL, "messages": []}), 400, "messages")
    assert_openai_error(httpx.post(url, json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}), 400, "role")
    assert_openai_error(httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": 3}]}), 400)
    assert_openai_error(
        httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
        400,
        "tools",
    )
    surrogate = b'{"model": "%s", "messages": [{"role": "user", "content": "a \\udfff b"}]}' % MODEL.encode()
    r = httpx.post(url, content=surrogate, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "messages.0.content", "surrogate")
    parts = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}
    assert_openai_error(httpx.post(url, content=json.dumps(parts), headers={"content-type": "application/json"}), 400, "surrogate")
    long = {"model": MODEL, "messages": [{"role": "user", "content": prompt_text(1, 3000)}]}
    assert_openai_error(httpx.post(url, json=long), 400, "2048")


def test_a_bad_body_gets_the_same_error_over_http_and_as_a_batch_result(start_gateway, tmp_path) -> None:
    template = tmp_path / "no-system.jinja"
    template.write_text(NO_SYSTEM_TEMPLATE)
    gw = start_gateway(KVPOOL_CHAT_TEMPLATE_FILE=str(template))  # no worker: every line is refused before a job exists
    over_http = {}
    for name, url, body in SAME_IN_A_BATCH:
        r = httpx.post(gw.url + url, content=json.dumps(body), headers={"content-type": "application/json"})
        over_http[name] = (r.status_code, assert_openai_error(r, r.status_code))
    assert {status for status, _ in over_http.values()} == {400, 404}
    assert over_http["content is a number"][1]["message"].startswith("messages.0.content")
    assert over_http["content is a number"][1]["param"] == "messages"
    assert over_http["a role the template refuses"][1]["message"] == "this template takes no system message"
    assert over_http["a schema the grammar cannot enforce"][1]["param"] == "response_format"

    client = openai_client(gw)
    in_batch = {}
    for endpoint in (CHAT, "/v1/completions"):
        lines = [{"custom_id": name, "method": "POST", "url": url, "body": body} for name, url, body in SAME_IN_A_BATCH if url == endpoint]
        f = client.files.create(file=("bad.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
        deadline = time.monotonic() + 60
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, f"batch still {batch.status}"
            time.sleep(0.1)
        assert batch.status == "completed" and batch.output_file_id is None
        for line in client.files.content(batch.error_file_id).text.splitlines():
            result = json.loads(line)
            in_batch[result["custom_id"]] = (result["response"]["status_code"], result["response"]["body"]["error"])
    assert in_batch == over_http


def test_a_bad_query_parameter_is_named_as_the_parameter(start_gateway) -> None:
    gw = start_gateway()
    err = assert_openai_error(httpx.get(gw.url + "/v1/batches", params={"limit": 0}), 400, "limit: ")
    assert err["param"] == "limit" and not err["message"].startswith("query")


def test_oversized_body_is_413(start_worker, start_gateway) -> None:
    start_worker("w1")
    gw = start_gateway(KVPOOL_MAX_BODY_BYTES="4096")
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 10_000})
    assert_openai_error(r, 413, "4096")

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit must hold as the body arrives
        yield b'{"model": "%s", "prompt": "' % MODEL.encode()
        for _ in range(5 * 1024):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(gw.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_openai_error(r, 413, "4096")


def test_the_worker_survives_bad_input(one_worker) -> None:
    w, gw = one_worker
    for body in [b[1] for b in BAD]:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        httpx.post(gw.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert w.proc.poll() is None
    ok = openai_client(gw).completions.create(model=MODEL, prompt="still here", max_tokens=3)
    assert ok.usage.completion_tokens <= 3


def test_no_live_worker_is_503_saying_so(start_worker, start_gateway) -> None:
    start_worker("w1").stop()  # a pool whose workers are gone (a pool still starting waits for one: test_pool_starting.py)
    gw = start_gateway()
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert_openai_error(r, 503, "no live worker")
    assert r.headers["retry-after"]
    ready = httpx.get(gw.url + "/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["workers"] == "no live worker"


def test_backpressure_answers_503_with_retry_after(start_worker, start_gateway, redis_url) -> None:
    """One job running and one waiting fill a limit of 1 waiting job: the next request gets 503 with Retry-After."""
    start_worker("w1")
    gw = start_gateway(KVPOOL_MAX_WAITING_JOBS="1")
    conn = redis.Redis.from_url(redis_url)
    body = {"model": MODEL, "prompt": prompt_text(2, 20), **LONG}
    statuses: list[int] = []

    def send() -> None:
        statuses.append(httpx.post(gw.url + "/v1/completions", json=body, timeout=120).status_code)

    running, waiting = threading.Thread(target=send), threading.Thread(target=send)
    running.start()
    poll(lambda: any(a.busy for a in adverts(conn)), "the first job to start")
    waiting.start()
    poll(lambda: _waiting_jobs(conn) == 1, "the second job to wait in a queue")
    r = httpx.post(gw.url + "/v1/completions", json=body, timeout=120)
    assert_openai_error(r, 503, "waiting")
    assert r.headers["retry-after"]
    running.join()
    waiting.join()
    assert statuses == [200, 200]
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "now", "max_tokens": 2})
    assert r.status_code == 200


def _waiting_jobs(conn: redis.Redis) -> int:
    return sum(conn.llen(k) for k in conn.scan_iter("rq:queue:*"))


def test_admission_is_atomic_under_a_burst(start_worker, start_gateway, redis_url) -> None:
    """24 requests at once against a limit of 4 waiting jobs: 4 wait, the rest get 503 at once.

    The worker is paused (SIGSTOP) while its advert is still live, so admitted jobs wait in the queue;
    a BLPOP it had already issued may still take one job off the queue (Redis hands it over).
    """
    w = start_worker("w1")
    gw = start_gateway(KVPOOL_MAX_WAITING_JOBS="4")
    conn = redis.Redis.from_url(redis_url)
    statuses: list[int] = []
    start = threading.Barrier(24)

    def send() -> None:
        start.wait()
        body = {"model": MODEL, "prompt": prompt_text(5, 10), "max_tokens": 2}
        statuses.append(httpx.post(gw.url + "/v1/completions", json=body, timeout=120).status_code)

    os.kill(w.proc.pid, signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=send) for _ in range(24)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(statuses) < 19:
            assert time.monotonic() < deadline, f"answered so far: {statuses}"
            time.sleep(0.02)
        assert conn.llen("rq:queue:kvpool") == 4
    finally:
        os.kill(w.proc.pid, signal.SIGCONT)
    for t in threads:
        t.join()
    assert sorted(set(statuses)) == [200, 503] and 4 <= statuses.count(200) <= 5, statuses


def test_request_timeout_is_504_and_cancels_the_job(start_worker, start_gateway, redis_url) -> None:
    w = start_worker("w1", KVPOOL_N_CTX="8192")
    gw = start_gateway(KVPOOL_REQUEST_TIMEOUT_S="1", KVPOOL_N_CTX="8192")
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "go", **LONG, "max_tokens": 8000}, timeout=60)
    assert_openai_error(r, 504, "1 s")
    deadline = time.monotonic() + 20
    while "finish_reason=cancelled" not in w.log():
        assert time.monotonic() < deadline, "the worker did not stop the timed-out job"
        time.sleep(0.2)


def test_a_client_that_disconnects_mid_stream_cancels_its_job(start_worker, start_gateway, redis_url) -> None:
    start_worker("w1", KVPOOL_N_CTX="8192")
    gw = start_gateway(KVPOOL_N_CTX="8192")
    conn = redis.Redis.from_url(redis_url)
    body = {"model": MODEL, "prompt": "go", **LONG, "max_tokens": 8000, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        job_id = json.loads(first[6:])["id"].removeprefix("cmpl-")
    deadline = time.monotonic() + 20
    while True:
        job = Job.fetch(job_id, connection=conn)
        if job.is_finished:
            break
        assert time.monotonic() < deadline, "the job went on after its client left"
        time.sleep(0.2)
    result = job.return_value()
    assert result["finish_reason"] == "cancelled"
    assert result["usage"]["completion_tokens"] < 8000


def test_a_client_that_leaves_a_plain_request_cancels_its_job(start_worker, start_gateway, redis_url) -> None:
    """No stream: the gateway still sees the connection close and stops the worker within a few seconds."""
    w = start_worker("w1", KVPOOL_N_CTX="8192")
    gw = start_gateway(KVPOOL_N_CTX="8192")
    body = {"model": MODEL, "prompt": "go", **LONG, "max_tokens": 8000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=2))
    deadline = time.monotonic() + 20
    while "finish_reason=cancelled" not in w.log():
        assert time.monotonic() < deadline, "the job went on after its client left"
        time.sleep(0.2)


def test_a_stream_whose_client_left_closes_its_body_at_once() -> None:
    """The body generator's ``finally`` (which cancels the job) must not wait for the garbage collector.

    Under ASGI 2.4 (uvicorn) a send to a gone client raises; Starlette then stops iterating
    the body but leaves the generator open and referenced, so only an explicit close runs
    its ``finally`` before the event loop ends.
    """
    from starlette.requests import ClientDisconnect

    from gateway.sse import EventStream

    closed: list[bool] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            for i in range(1000):
                yield f"data: {i}\n\n".encode()
        finally:
            closed.append(True)

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            raise OSError("the client has gone")

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def respond() -> list[bool]:
        generator = body()
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/", "headers": []}
        with pytest.raises(ClientDisconnect):
            await EventStream(generator)(scope, receive, send)
        return list(closed)  # before the event loop ends, which would close every open generator

    assert anyio.run(respond) == [True]


def test_killing_the_only_worker_mid_stream_ends_the_stream_with_an_error(start_worker, start_gateway) -> None:
    w = start_worker("w1", KVPOOL_N_CTX="8192")
    gw = start_gateway(KVPOOL_N_CTX="8192")
    client = openai_client(gw)
    stream = client.completions.create(model=MODEL, prompt="go", stream=True, temperature=0, max_tokens=8000, logit_bias={"2": -100})
    got = 0
    with pytest.raises(openai.APIError) as err:
        for _chunk in stream:
            got += 1
            if got == 5:
                w.kill()
    assert "died" in str(err.value) or "worker" in str(err.value)
    start_worker("w2", KVPOOL_N_CTX="8192")
    again = client.completions.create(model=MODEL, prompt="again", max_tokens=4, temperature=0)
    assert again.model_extra["kvpool"]["worker"] == "w2"


def test_fuzzed_requests_never_get_a_server_error(one_worker) -> None:
    """Property-based: requests generated from the app's own OpenAPI schema (schemathesis), valid and not."""
    _, gw = one_worker
    schema = schemathesis.openapi.from_url(gw.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/v1/files",
        "/v1/files/{file_id}/content",
        "/v1/batches",
        "/v1/batches/{batch_id}",
        "/v1/batches/{batch_id}/cancel",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/input_items",
    }
    seen: dict[int, int] = {}
    for op in operations:

        @given(case=op.as_strategy(), served_model=st.booleans())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case, served_model: bool) -> None:
            if served_model and isinstance(case.body, dict):
                case.body["model"] = MODEL  # reach past the model check into the job path
            response = case.call(base_url=gw.url, timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500 or response.status_code in (503, 529), response.text
            if response.status_code >= 400:
                body = response.json()
                if case.operation.path.startswith("/v1/messages"):  # Anthropic's API, Anthropic's error shape
                    assert body.get("type") == "error" and set(body["error"]) == {"type", "message"}, body
                else:
                    assert set(body.get("error", {})) >= {"message", "type", "param", "code"}, body

        check()
    assert sum(seen.values()) >= 60, seen
    assert 200 in seen and 400 in seen and 404 in seen, seen


def test_a_job_that_fails_for_good_is_502_with_the_workers_reason(start_worker, start_gateway) -> None:
    start_worker("w1", KVPOOL_N_CTX="64")  # the gateway admits prompts of up to 2048 tokens; this worker holds 64
    gw = start_gateway()
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": prompt_text(3, 100), "max_tokens": 2}, timeout=60)
    err = assert_openai_error(r, 502, "does not fit the context of 64")
    assert err["code"] == "worker_error"
