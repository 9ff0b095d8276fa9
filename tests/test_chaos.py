"""Faults under load: nothing lost, nothing hung, nothing wrong, nothing done twice.

A real pool (redis-server with AOF, S3 over HTTP, three workers on the real SmolLM2
model, one of them on other CPU kernels, and two gateways) serves four concurrent
clients, half streaming, while one fault after another strikes: a worker is SIGKILLed
mid-job and restarted under its name; Redis stops, a worker gets SIGTERM while it is
away, and Redis comes back; S3 goes away and comes back empty; stored blobs are
corrupted; a gateway is SIGKILLed and restarted. Every request carries an
``Idempotency-Key``, and a client whose connection fails retries on the other gateway
with the same key, as a client behind a load balancer does. Every answer is compared
with the cold evaluation of the same prompt. The test counts what came back, by class,
and asserts:

* no wrong answer, no request that hung past its deadline, no 5xx, and none lost: every
  request is answered, by its first gateway or by the other;
* nothing evaluated twice for one request: every job in RQ is the answer of one request;
* the worker sent SIGTERM while Redis was away exits 0 at once;
* once S3 is back empty, the index keeps no entry whose blob is gone;
* the worker on other kernels shares no chunk with the others: its namespace is its own;
* after each fault, the pool answers correctly again within `RECOVERY_S` seconds.

The figures are printed (``pytest -s``) for the record.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import httpx
import llama_cpp
import pytest
import redis

from gateway.pool.procs import S3_ACCESS_KEY, S3_SECRET_KEY, GatewayProcess, RedisServer, WorkerProcess, free_port
from gateway.pool.s3server import S3Server
from gateway.prepare import Preparer
from gateway.schemas import ChatCompletionRequest
from gateway.settings import GatewaySettings
from gateway.tenants import Tenants
from store.blob import BlobName
from store.index import RedisIndex
from store.maintenance import UNKNOWN_KERNELS, bytes_by_kernels
from tests.helpers import THREADS, cold_generate, env_for_pool, s3_client, s3_settings
from worker.engine.context import flash_attn_for

CLIENTS = 4
MAX_TOKENS = 12
RECOVERY_S = 10.0
REQUEST_TIMEOUT_S = 60.0
BUCKET = "kvpool-chaos"
QUESTIONS = ["Summarise this in one sentence.", "What is the main idea?", "Name one thing it mentions."]
OTHER_KERNELS = {"GGML_CPU_TILED_MM_FORCE": "1"}
"""A switch llama.cpp reads at start-up to pick other matrix kernels: a worker of another kernel fingerprint on this machine."""

pytestmark = pytest.mark.fp_path  # answers are compared with a cold run, bit for bit or token for token


@dataclass
class Outcome:
    prompt: int
    stream: bool
    started: float
    ended: float
    kind: str  # "ok", "wrong", "hung", "http_<status>_<code>", "stream_error_<code>", "stream_cut", "connection"
    job: str | None = None
    worker: str | None = None
    attempts: int = 1
    text: str | None = None


@dataclass
class Pool:
    env: dict[str, str]
    redis: RedisServer
    s3: S3Server
    ports: tuple[int, int]
    tmp: Path
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    gateways: dict[int, GatewayProcess] = field(default_factory=dict)
    starts: Counter[str] = field(default_factory=Counter)

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def conn(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url)

    def start_worker(self, name: str, **env: str) -> None:
        self.starts[name] += 1
        self.workers[name] = WorkerProcess(name, {**self.env, **env}, self.tmp / f"{name}-{self.starts[name]}.log").start()

    def start_gateway(self, i: int) -> None:
        self.starts[f"gateway{i}"] += 1
        self.gateways[i] = GatewayProcess(self.env, self.ports[i], self.tmp / f"gateway{i}-{self.starts[f'gateway{i}']}.log").start()


def _documents(count: int, words: int) -> list[str]:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text().split()
    return [" ".join(text[i * words : (i + 1) * words]) for i in range(count)]


def _bodies() -> list[dict]:
    return [
        {
            "model": "smollm2",
            "messages": [{"role": "system", "content": doc}, {"role": "user", "content": q}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        for doc in _documents(2, 120)
        for q in QUESTIONS
    ]


def _references(model: Path, settings: GatewaySettings, bodies: list[dict]) -> list[str]:
    """Each prompt's answer from a cold evaluation in this process, tokenized as the gateway does."""
    preparer = Preparer(settings, model)
    tenant = Tenants({}, settings.tenant_secret).resolve(None)
    llm = llama_cpp.Llama(
        str(model), n_ctx=2048, n_threads=THREADS, n_threads_batch=THREADS, verbose=False, flash_attn=flash_attn_for(model, None)
    )
    out = []
    for body in bodies:
        tokens = preparer.chat(ChatCompletionRequest.model_validate(body), tenant).spec.tokens
        generated = cold_generate(llm, tokens, MAX_TOKENS, temp=0.0)
        out.append(llm.detokenize(generated).decode("utf-8", "replace"))
    llm.close()
    return out


def _ask(url: str, body: dict, stream: bool, key: str) -> tuple[str, dict | None]:
    """(kind, answer): one request as a client sends it; the answer holds its text, its id and the worker."""
    headers = {"Idempotency-Key": key}
    try:
        if not stream:
            r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=REQUEST_TIMEOUT_S + 30)
            if r.status_code != 200:
                return f"http_{r.status_code}_{r.json().get('error', {}).get('code')}", None
            doc = r.json()
            return "answer", {"text": doc["choices"][0]["message"]["content"], "id": doc["id"], "worker": doc["kvpool"]["worker"]}
        text, done, last = "", False, {}
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=REQUEST_TIMEOUT_S + 30) as r:
            if r.status_code != 200:
                r.read()
                return f"http_{r.status_code}_{r.json().get('error', {}).get('code')}", None
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    doc = json.loads(line[6:])
                    if "error" in doc:
                        return f"stream_error_{doc['error'].get('code')}", None
                    last = doc
                    text += (doc["choices"][0]["delta"].get("content") or "") if doc["choices"] else ""
        return (
            ("answer", {"text": text, "id": last.get("id"), "worker": (last.get("kvpool") or {}).get("worker")})
            if done
            else ("stream_cut", None)
        )
    except httpx.TimeoutException:
        return "hung", None
    except (httpx.TransportError, json.JSONDecodeError):
        return "connection", None


def _ask_until_answered(pool: Pool, first: int, body: dict, stream: bool, key: str) -> tuple[str, dict | None, int]:
    """A client behind a load balancer: a failed connection is tried again on the other gateway, with the same key."""
    gw, attempts, deadline = first, 0, time.monotonic() + 2 * REQUEST_TIMEOUT_S
    while True:
        attempts += 1
        kind, answer = _ask(pool.url(gw), body, stream, key)
        if kind not in ("connection", "stream_cut") or time.monotonic() > deadline:
            return kind, answer, attempts
        gw = 1 - gw
        time.sleep(0.2)  # a client backs off before it tries again


def _client(pool: Pool, bodies: list[dict], refs: list[str], seed: int, stop: threading.Event, out: list[Outcome]) -> None:
    i = seed
    while not stop.is_set():
        n, stream = i % len(bodies), i % 2 == 0
        t0 = time.monotonic()
        kind, answer, attempts = _ask_until_answered(pool, (i // CLIENTS) % 2, bodies[n], stream, uuid.uuid4().hex)
        job = worker = None
        if kind == "answer" and answer is not None:
            kind = "ok" if answer["text"] == refs[n] else "wrong"
            job, worker = (answer["id"] or "").partition("-")[2] or None, answer["worker"]
        text = answer["text"] if kind == "wrong" and answer is not None else None
        out.append(Outcome(n, stream, t0, time.monotonic(), kind, job, worker, attempts, text))
        i += CLIENTS


def _recovered_after(out: list[Outcome], t: float) -> float:
    """Seconds from ``t`` to the end of the first correct answer to a request sent after ``t``."""
    deadline = time.monotonic() + RECOVERY_S + 30
    while time.monotonic() < deadline:
        done = [o.ended for o in list(out) if o.kind == "ok" and o.started >= t]
        if done:
            return min(done) - t
        time.sleep(0.1)
    return float("inf")


def _corrupt_blobs(pool: Pool, count: int) -> int:
    s = s3_settings(pool.s3.endpoint_url, BUCKET, pool.redis.url)
    s3 = s3_client(s)
    try:
        listed = s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])
    except s3.exceptions.NoSuchBucket:
        return 0  # not created again yet: nothing has been stored since S3 came back
    keys = [o["Key"] for o in listed if "/chunks/" in o["Key"]][:count]
    for key in keys:
        blob = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        blob[len(blob) // 2] ^= 0xFF
        s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(blob))
    return len(keys)


def _rq_jobs(conn: redis.Redis) -> set[str]:
    """Every job RQ holds (finished jobs are kept for an hour)."""
    return {k.decode().removeprefix("rq:job:") for k in conn.scan_iter("rq:job:*") if k.count(b":") == 2}


def _entries_without_blobs(pool: Pool) -> int:
    """Index entries whose blob is not in the bucket (the index is read first: a blob is always written before its entry)."""
    entries = list(RedisIndex(pool.conn()).entries())
    s3 = boto3.client(
        "s3",
        endpoint_url=pool.s3.endpoint_url,
        aws_access_key_id=S3_ACCESS_KEY,
        aws_secret_access_key=S3_SECRET_KEY,
        region_name="us-east-1",
    )
    try:
        names = {
            o["Key"].removeprefix("pool/")
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            for o in page.get("Contents", [])
        }
    except s3.exceptions.NoSuchBucket:
        names = set()
    return sum(str(BlobName(e.namespace, e.index, e.key, tail=e.tail)) not in names for e in entries)


def _sigterm_while_redis_is_away(pool: Pool, name: str) -> tuple[int | None, float]:
    """Stop Redis, send ``name`` SIGTERM (Kubernetes' scale-down), wait for it to exit; then Redis comes back and so does the worker."""
    pool.redis.stop()
    proc = pool.workers[name].proc
    assert proc is not None
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc: int | None = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        rc = None
    took = time.monotonic() - t0
    pool.workers[name].kill()
    pool.redis = RedisServer(pool.tmp / "redis", port=pool.redis.port, persist=True).start()
    return rc, took


def _poll(done, what: str, timeout_s: float = 60.0) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.2)
    return time.monotonic() - t0


@pytest.fixture
def pool(tmp_path: Path, smollm2: Path) -> Iterator[Pool]:
    server = RedisServer(tmp_path / "redis", persist=True).start()
    s3 = S3Server().start()
    env = {
        **env_for_pool(server.url, s3_settings(s3.endpoint_url, BUCKET, server.url), smollm2, 64),
        "KVPOOL_MODEL_NAME": "smollm2",
        "KVPOOL_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
    }
    p = Pool(env, server, s3, (free_port(), free_port()), tmp_path)
    try:
        yield p
    finally:
        for g in p.gateways.values():
            g.stop()
        for w in p.workers.values():
            w.kill()
        s3.stop()
        p.redis.stop()


def test_faults_under_load_lose_nothing_and_answer_right(pool: Pool, smollm2: Path) -> None:
    bodies = _bodies()
    refs = _references(smollm2, GatewaySettings(model=str(smollm2), model_name="smollm2", chunk_size=64, n_ctx=2048), bodies)
    pool.start_worker("w1")
    pool.start_worker("w2")
    pool.start_worker("w3", **OTHER_KERNELS)
    pool.start_gateway(0)
    pool.start_gateway(1)
    out: list[Outcome] = []
    stop = threading.Event()
    clients = [threading.Thread(target=_client, args=(pool, bodies, refs, i, stop, out)) for i in range(CLIENTS)]
    for c in clients:
        c.start()
    recovery: dict[str, float] = {}
    probes: set[str] = set()
    try:
        warm_up = _recovered_after(out, time.monotonic())

        pool.workers["w1"].kill()  # SIGKILL, mid-job under this load
        pool.start_worker("w1")
        recovery["worker killed and restarted"] = _recovered_after(out, time.monotonic())

        sigterm_rc, sigterm_s = _sigterm_while_redis_is_away(pool, "w2")
        recovery["redis restarted"] = _recovered_after(out, time.monotonic())
        pool.start_worker("w2")

        pool.s3.stop()
        time.sleep(2)  # S3 away under load
        pool.s3.wipe()
        pool.s3.start()  # back, its disk lost: no bucket and no blobs
        recovery["s3 back empty"] = _recovered_after(out, time.monotonic())
        healed_s = _poll(lambda: _entries_without_blobs(pool) == 0, "the index to drop the entries of blobs S3 lost")

        fresh = {**bodies[0], "messages": [{"role": "system", "content": _documents(3, 120)[2]}, {"role": "user", "content": QUESTIONS[0]}]}
        kind, answer, _ = _ask_until_answered(pool, 0, fresh, False, uuid.uuid4().hex)  # a prompt the store never saw
        assert kind == "answer" and answer is not None
        probes.add(answer["id"].partition("-")[2])
        corrupted: list[int] = []
        _poll(
            lambda: bool(corrupted.append(_corrupt_blobs(pool, 3)) or corrupted[-1]), "something stored again after S3 came back empty", 30
        )
        recovery["blobs corrupted"] = _recovered_after(out, time.monotonic())

        pool.gateways[0].kill()  # SIGKILL: its clients' connections die with it, and they retry on gateway 1
        pool.start_gateway(0)
        recovery["gateway killed and restarted"] = _recovered_after(out, time.monotonic())
    finally:
        stop.set()
        for c in clients:
            c.join(2 * REQUEST_TIMEOUT_S + 60)

    kinds = Counter(o.kind for o in out)
    answered = [o for o in out if o.kind in ("ok", "wrong")]
    jobs = _rq_jobs(pool.conn())
    twice = jobs - {o.job for o in answered} - probes
    retried = sum(o.attempts > 1 for o in out)
    described = RedisIndex(pool.conn()).descriptions()
    kernels = bytes_by_kernels(list(RedisIndex(pool.conn()).entries()), described)
    by_worker = Counter(o.worker for o in answered)
    print(
        f"\nchaos: {len(out)} sent, {len(answered)} answered ({retried} after a retry on the other gateway), {kinds['wrong']} wrong, "
        f"{len(out) - len(answered)} lost, {len(twice)} evaluated twice; {len(jobs)} jobs; by worker {dict(by_worker)}; {dict(kinds)}"
    )
    print(f"first answer {warm_up:.2f} s; recovery (s): " + ", ".join(f"{k} {v:.2f}" for k, v in recovery.items()))
    print(f"SIGTERM with Redis away: exit {sigterm_rc} after {sigterm_s:.2f} s; index healed {healed_s:.2f} s after S3 came back empty")
    print(f"bytes by kernels: {kernels}")
    stranded = sum(log.read_text().count("job.stranded") for log in pool.tmp.glob("gateway*.log"))
    print(f"jobs a dying worker popped but never started, queued again by a gateway: {stranded}")
    wrong = [
        f"prompt {o.prompt} stream={o.stream} worker={o.worker} job={o.job}: {o.text!r} != {refs[o.prompt]!r}"
        for o in out
        if o.kind == "wrong"
    ]
    assert kinds["wrong"] == 0 and kinds["hung"] == 0, "\n".join(wrong)
    assert set(kinds) == {"ok"}, f"not answered: {dict(kinds)}"
    assert not twice, f"jobs that answered no request: {sorted(twice)}"
    assert len({o.job for o in answered}) == len(answered), "two requests answered by one job"
    assert sigterm_rc == 0, f"a worker sent SIGTERM while Redis was away exited with {sigterm_rc}"
    assert by_worker["w3"] > 0 and len(set(kernels) - {UNKNOWN_KERNELS}) == 2, (
        by_worker,
        kernels,
    )  # the other kernels' worker served, from chunks of its own
    assert len(answered) >= 20
    assert all(v <= RECOVERY_S for v in recovery.values()), recovery
