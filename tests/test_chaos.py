"""Faults under load: nothing lost, nothing hung, nothing wrong.

A real pool (redis-server with AOF, S3 over HTTP, two workers on the real SmolLM2 model,
one gateway) serves four concurrent clients, half streaming, while one fault after
another strikes: a worker is SIGKILLed mid-job and restarted under its name, Redis
restarts, S3 goes away and comes back empty, stored blobs are corrupted, and the gateway
is SIGKILLed and restarted. Every answer is compared with the cold evaluation of the same
prompt. The test counts what came back, by class, and asserts:

* no wrong answer, and no request that hung past its deadline;
* no 5xx at all, and no failed request except those in flight at the killed gateway or
  sent while it was down (connection errors: there was no server to answer);
* after each fault, the pool answers correctly again within `RECOVERY_S` seconds.

The figures are printed (``pytest -s``) for the record.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import httpx
import llama_cpp
import pytest
import redis

from gateway.pool.procs import GatewayProcess, RedisServer, S3Server, WorkerProcess, free_port
from gateway.prepare import Preparer
from gateway.schemas import ChatCompletionRequest
from gateway.settings import GatewaySettings
from gateway.tenants import Tenants
from tests.conftest import env_for_pool, s3_settings
from worker.llama_state import evaluate_prompt, is_end_of_generation

CLIENTS = 4
MAX_TOKENS = 12
RECOVERY_S = 10.0
REQUEST_TIMEOUT_S = 60.0
BUCKET = "kvpool-chaos"
QUESTIONS = ["Summarise this in one sentence.", "What is the main idea?", "Name one thing it mentions."]

pytestmark = pytest.mark.fp_path  # answers are compared with a cold run, bit for bit or token for token


@dataclass
class Outcome:
    prompt: int
    stream: bool
    started: float
    ended: float
    kind: str  # "ok", "wrong", "hung", "http_<status>_<code>", "stream_error_<code>", "stream_cut", "connection"


@dataclass
class Pool:
    env: dict[str, str]
    redis: RedisServer
    s3: S3Server
    port: int
    tmp: Path
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    gateway: GatewayProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def conn(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url)

    def start_worker(self, name: str) -> None:
        log = self.tmp / f"{name}.log"
        self.workers[name] = WorkerProcess(name, self.env, log).start()

    def start_gateway(self) -> None:
        self.gateway = GatewayProcess(self.env, self.port, self.tmp / "gateway.log").start()


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
    llm = llama_cpp.Llama(str(model), n_ctx=2048, n_threads=2, verbose=False)
    out = []
    for body in bodies:
        tokens = preparer.chat(ChatCompletionRequest.model_validate(body), tenant).spec.tokens
        llm.reset()
        evaluate_prompt(llm, tokens, 0)
        generated: list[int] = []
        for tok in llm.generate(tokens, temp=0.0, reset=True):
            if is_end_of_generation(llm, tok) or len(generated) >= MAX_TOKENS:
                break
            generated.append(tok)
        out.append(llm.detokenize(generated).decode("utf-8", "replace"))
    llm.close()
    return out


def _ask(url: str, body: dict, stream: bool) -> tuple[str, str | None]:
    """(kind, text): one request as a client sends it."""
    try:
        if not stream:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S + 30)
            if r.status_code != 200:
                return f"http_{r.status_code}_{r.json().get('error', {}).get('code')}", None
            return "answer", r.json()["choices"][0]["message"]["content"]
        text, done = "", False
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=REQUEST_TIMEOUT_S + 30) as r:
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
                    text += doc["choices"][0]["delta"].get("content") or ""
        return ("answer", text) if done else ("stream_cut", None)
    except httpx.TimeoutException:
        return "hung", None
    except (httpx.TransportError, json.JSONDecodeError):
        return "connection", None


def _client(pool: Pool, bodies: list[dict], refs: list[str], seed: int, stop: threading.Event, out: list[Outcome]) -> None:
    i = seed
    while not stop.is_set():
        n, stream = i % len(bodies), i % 2 == 0
        t0 = time.monotonic()
        kind, text = _ask(pool.url, bodies[n], stream)
        if kind == "answer":
            kind = "ok" if text == refs[n] else "wrong"
        out.append(Outcome(n, stream, t0, time.monotonic(), kind))
        if kind == "connection":
            time.sleep(0.2)  # the gateway is down: a client backs off before it tries again
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
    s3 = boto3.client(
        "s3",
        endpoint_url=s.s3_endpoint_url,
        aws_access_key_id=s.s3_access_key_id,
        aws_secret_access_key=s.s3_secret_access_key,
        region_name="us-east-1",
    )
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


@pytest.fixture
def pool(tmp_path: Path, smollm2: Path) -> Iterator[Pool]:
    server = RedisServer(tmp_path / "redis", persist=True).start()
    s3 = S3Server().start()
    env = {
        **env_for_pool(server.url, s3_settings(s3.endpoint_url, BUCKET, server.url), smollm2, 64),
        "KVPOOL_MODEL_NAME": "smollm2",
        "KVPOOL_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
    }
    p = Pool(env, server, s3, free_port(), tmp_path)
    try:
        yield p
    finally:
        if p.gateway is not None:
            p.gateway.stop()
        for w in p.workers.values():
            w.kill()
        s3.stop()
        p.redis.stop()


def test_faults_under_load_lose_nothing_and_answer_right(pool: Pool, smollm2: Path) -> None:
    bodies = _bodies()
    refs = _references(smollm2, GatewaySettings(model=str(smollm2), model_name="smollm2", chunk_size=64, n_ctx=2048), bodies)
    for name in ("w1", "w2"):
        pool.start_worker(name)
    pool.start_gateway()
    out: list[Outcome] = []
    stop = threading.Event()
    clients = [threading.Thread(target=_client, args=(pool, bodies, refs, i, stop, out)) for i in range(CLIENTS)]
    for c in clients:
        c.start()
    recovery: dict[str, float] = {}
    gateway_down: tuple[float, float] = (0.0, 0.0)
    try:
        warm_up = _recovered_after(out, time.monotonic())

        pool.workers["w1"].kill()  # SIGKILL, mid-job under this load
        pool.start_worker("w1")
        recovery["worker killed and restarted"] = _recovered_after(out, time.monotonic())

        pool.redis.stop()
        pool.redis = RedisServer(pool.tmp / "redis", port=pool.redis.port, persist=True).start()
        recovery["redis restarted"] = _recovered_after(out, time.monotonic())

        pool.s3.stop()
        time.sleep(2)  # S3 away under load
        pool.s3.start()  # back, with no bucket and no blobs
        recovery["s3 back empty"] = _recovered_after(out, time.monotonic())

        fresh = {**bodies[0], "messages": [{"role": "system", "content": _documents(3, 120)[2]}, {"role": "user", "content": QUESTIONS[0]}]}
        assert _ask(pool.url, fresh, stream=False)[0] == "answer"  # a prompt the store never saw: it must be stored anew
        deadline = time.monotonic() + 30
        while not (corrupted := _corrupt_blobs(pool, 3)) and time.monotonic() < deadline:
            time.sleep(0.5)  # the publisher runs in the background
        assert corrupted, "nothing was stored again after S3 came back empty"
        recovery["blobs corrupted"] = _recovered_after(out, time.monotonic())

        assert pool.gateway is not None and pool.gateway.proc is not None
        killed = time.monotonic()
        pool.gateway.proc.kill()
        pool.gateway.proc.wait()
        pool.start_gateway()
        gateway_down = (killed, time.monotonic())
        recovery["gateway killed and restarted"] = _recovered_after(out, gateway_down[1])
    finally:
        stop.set()
        for c in clients:
            c.join(REQUEST_TIMEOUT_S + 60)

    kinds = Counter(o.kind for o in out)
    print(f"\nchaos: {len(out)} requests: {dict(kinds)}; corrupted blobs: {corrupted}")
    print(f"first answer {warm_up:.2f} s; recovery (s): " + ", ".join(f"{k} {v:.2f}" for k, v in recovery.items()))
    assert kinds["wrong"] == 0 and kinds["hung"] == 0
    assert not [o for o in out if o.kind.startswith("http_5") or o.kind.startswith("stream_error")], dict(kinds)
    lost = [o for o in out if o.kind in ("connection", "stream_cut") and not (o.started <= gateway_down[1] and o.ended >= gateway_down[0])]
    assert not lost, f"failed away from the gateway's death: {lost}"
    assert not [o for o in out if o.kind not in ("ok", "connection", "stream_cut")], dict(kinds)
    assert kinds["ok"] >= 20
    assert all(v <= RECOVERY_S for v in recovery.values()), recovery
