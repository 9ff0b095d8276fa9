"""What tests share besides fixtures: pool settings, prompts, cold reference runs, clients, polling.

Fixtures live in the conftests; a test module imports these from here, never from a conftest.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import boto3
import httpx
import llama_cpp
import numpy as np
import openai
import redis
from prometheus_client.parser import text_string_to_metric_families

from gateway.pool.procs import S3_ACCESS_KEY, S3_SECRET_KEY, GatewayProcess, RedisServer, WorkerProcess, free_port, start_together
from gateway.pool.s3server import S3Server
from store.chain import Namespace
from store.fingerprint import fingerprint_file
from store.settings import StoreSettings
from store.store import Store
from worker.advert import adverts
from worker.client import events, submit
from worker.engine.decoding import DecodeMode, choose_mode, decode_step
from worker.engine.llama_state import evaluate_prompt, last_logits
from worker.engine.loop import EngineLoop
from worker.protocol import DoneEvent, ErrorEvent, JobResult, JobSpec, SamplingParams, StartEvent, TokenEvent, job_spec, worker_queue
from worker.settings import WorkerSettings


def s3_settings(endpoint_url: str, bucket: str, redis_url: str, *, prefix: str = "pool", **overrides: object) -> StoreSettings:
    return StoreSettings(
        store_url=f"s3://{bucket}/{prefix}",
        s3_endpoint_url=endpoint_url,
        s3_access_key_id=S3_ACCESS_KEY,
        s3_secret_access_key=S3_SECRET_KEY,
        redis_url=redis_url,
        connect_timeout_s=1.0,
        read_timeout_s=2.0,
        retries=1,
        **overrides,
    )


def s3_client(s: StoreSettings) -> Any:
    """A boto3 client of the test S3 server that ``s`` names (to reach blobs behind the store's back)."""
    return boto3.client(
        "s3",
        endpoint_url=s.s3_endpoint_url,
        aws_access_key_id=s.s3_access_key_id,
        aws_secret_access_key=s.s3_secret_access_key,
        region_name="us-east-1",
    )


POOL_CHUNK = 32

THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
"""llama.cpp threads of a model a test runs itself (in this process, or one worker it names): the cores shared out among
the suite's test processes (`tests/run.py`). llama.cpp's threads spin while they wait for each other, so threads that
outnumber the cores run far slower than their share; the bits are the same for any count (`worker.kernels`)."""


def env_for_pool(redis_url: str, s: StoreSettings, model: Path, chunk_size: int) -> dict[str, str]:
    """KVPOOL_* settings for worker and gateway processes: this Redis, this store, this model; short timeouts."""
    return {
        "KVPOOL_REDIS_URL": redis_url,
        "KVPOOL_STORE_URL": s.store_url,
        "KVPOOL_S3_ENDPOINT_URL": s.s3_endpoint_url or "",
        "KVPOOL_S3_ACCESS_KEY_ID": s.s3_access_key_id or "",
        "KVPOOL_S3_SECRET_ACCESS_KEY": s.s3_secret_access_key or "",
        "KVPOOL_MODEL": str(model),
        "KVPOOL_CHUNK_SIZE": str(chunk_size),
        "KVPOOL_N_CTX": "2048",
        "KVPOOL_N_THREADS": "1",
        "KVPOOL_HEARTBEAT_S": "0.5",
        "KVPOOL_CONNECT_TIMEOUT_S": "1",
        "KVPOOL_READ_TIMEOUT_S": "2",
        "KVPOOL_RETRIES": "1",
    }


def cold_greedy(llm: llama_cpp.Llama, tokens: list[int], n: int) -> list[int]:
    """Greedy continuation of ``tokens`` evaluated from scratch, stopping at end-of-generation like the worker."""
    return cold_generate(llm, tokens, n, temp=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0)


def cold_answer(llm: llama_cpp.Llama, tokens: list[int], n: int = 8) -> tuple[np.ndarray, list[int]]:
    """The first token's logits and the greedy answer of a cold evaluation of ``tokens``, the prompt evaluated once."""
    first: list[np.ndarray] = []
    answer = cold_generate(llm, tokens, n, prompt_logits=first, temp=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0)
    return first[0], answer


def cold_generate(
    llm: llama_cpp.Llama, tokens: list[int], n: int, *, prompt_logits: list[np.ndarray] | None = None, **sampling: float
) -> list[int]:
    """What a worker answers: the prompt evaluated from scratch in the worker's batches, then each token sampled by
    llama-cpp-python's sampler chain (``sampling`` as `Llama.generate` takes it) and decoded so that its cells are a
    cold evaluation's, as the worker does (`worker.engine.decoding`); stops at end-of-generation or ``n`` tokens.
    ``prompt_logits`` gets a copy of the logits the prompt's evaluation gave (the first token's)."""
    mode: DecodeMode | None = getattr(llm, "kvpool_decode_mode", None)
    if mode is None:  # checked once per model object (an id could be reused by another model once this one is freed)
        mode = llm.kvpool_decode_mode = choose_mode(llm, "auto")[0]
    llm.reset()
    evaluate_prompt(llm, tokens, 0)  # so the last batch never holds a lone token
    if prompt_logits is not None:
        prompt_logits.append(last_logits(llm).copy())
    llm._sampler = llm._init_sampler(**sampling)
    out: list[int] = []
    while len(out) < n:
        tok = llm.sample(idx=None)
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
            break
        out.append(tok)
        if len(out) < n:
            decode_step(llm, tok, mode)
    llm._sampler = None
    llm.reset()
    return out


def prompt_text(seed: int, words: int) -> str:
    rng = np.random.default_rng(seed)
    vocab = "the a of and to in is was for on that with as by at from this be or an are it his her they we you".split()
    vocab += "river mountain signal engine memory garden window silver letter market winter harbor lantern".split()
    return " ".join(rng.choice(vocab, words))


def wait_settled(redis_url: str, timeout_s: float = 30.0) -> None:
    """Poll until every live worker is idle with nothing left to publish: what it evaluated is in the store."""
    conn = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    while True:
        ads = adverts(conn)
        if ads and all(not a.busy and a.pending == 0 for a in ads):
            return
        assert time.monotonic() < deadline, f"workers still busy or publishing: {[(a.worker, a.busy, a.pending) for a in ads]}"
        time.sleep(0.05)


def stored_depth(store: Store, ns: Namespace, keys: Sequence[bytes]) -> int:
    """How many chunks from the start of the chain ``keys`` the store holds (`Store.find` without a tail)."""
    return store.find(ns, [], keys).depth


MODEL = "kvpool-tiny-s0"


@dataclass(frozen=True)
class Tenancy:
    """A test's own tenant on a gateway that many tests share: the gateway's URL and an API key no other test sends.

    Tenants never share cache entries, so what one test sent never shows up as cached tokens in another's answers.
    """

    url: str
    api_key: str
    redis_url: str

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"}

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=120, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, timeout=120, **kwargs)


def openai_client(gateway: GatewayProcess | Tenancy, api_key: str | None = None) -> openai.OpenAI:
    """The official client; on a shared gateway (a `Tenancy`) it sends that tenant's key unless told another."""
    key = api_key or (gateway.api_key if isinstance(gateway, Tenancy) else "unused")
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=120)


SMOL = "SmolLM2-135M-Instruct.Q4_1"


TOOLS_TEMPLATE = Path(__file__).resolve().parents[1] / "gateway" / "templates" / "chatml-tools.jinja"


@dataclass
class Outcome:
    result: JobResult | None
    starts: list[StartEvent] = field(default_factory=list)
    tokens: list[TokenEvent] = field(default_factory=list)
    error: ErrorEvent | None = None

    @property
    def streamed_text(self) -> str:
        return "".join(t.text for t in self.tokens)


class PoolClient:
    """Submits jobs the way the gateway does: tokens, chain keys, tenant salt, sampling."""

    def __init__(self, conn: redis.Redis, model: Path, n_ctx: int = 2048) -> None:
        self.conn = conn
        self.settings = WorkerSettings(
            model=str(model), chunk_size=POOL_CHUNK, n_ctx=n_ctx
        )  # the model: what the namespace is resolved for
        self.fingerprint = fingerprint_file(model)
        self.vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)

    def tokens(self, text: str) -> list[int]:
        return self.vocab.tokenize(text.encode())

    def spec(self, tokens: list[int], *, tenant: str = "", chain: list[str] | None = None, **sampling: object) -> JobSpec:
        spec = job_spec(
            tokens,
            model=self.fingerprint,
            chunk_size=POOL_CHUNK,
            tenant_salt=tenant,
            sampling=SamplingParams(**{"max_tokens": 24, "temperature": 0.0, **sampling}),
        )
        return spec if chain is None else spec.model_copy(update={"chain": chain})

    def submit(self, spec: JobSpec, *, worker: str | None = None, attempts: int = 3) -> str:
        queue = worker_queue(worker) if worker else self.settings.queue
        return submit(self.conn, spec, queue=queue, attempts=attempts).id

    def collect(self, job_id: str, timeout_s: float = 120.0) -> Outcome:
        out = Outcome(result=None)
        for ev in events(self.conn, job_id, timeout_s=timeout_s):
            if isinstance(ev, StartEvent):
                out.starts.append(ev)
                out.tokens.clear()
            elif isinstance(ev, TokenEvent):
                out.tokens.append(ev)
            elif isinstance(ev, DoneEvent):
                out.result = ev.result
            elif isinstance(ev, ErrorEvent):
                out.error = ev
        return out

    def run(self, tokens: list[int], *, worker: str | None = None, **kw: object) -> JobResult:
        out = self.collect(self.submit(self.spec(tokens, **kw), worker=worker))
        assert out.result is not None, f"job failed: {out.error}"
        return out.result


@dataclass
class Pool:
    gateway: GatewayProcess
    workers: dict[str, WorkerProcess]
    env: dict[str, str]
    redis_url: str
    store: StoreSettings
    logs: Path

    def client(self, **kwargs: object) -> anthropic.Anthropic:
        kwargs.setdefault("api_key", "unused")
        return anthropic.Anthropic(base_url=self.gateway.url, max_retries=0, timeout=600, **kwargs)  # type: ignore[arg-type]

    def start_worker(self, name: str) -> WorkerProcess:
        w = WorkerProcess(name, self.env, self.logs / f"{name}.log").start()
        self.workers[name] = w
        return w


@contextmanager
def running_pool(redis_server: RedisServer, s3_server: S3Server, model: Path, logs: Path, workers: list[str], **env: str) -> Iterator[Pool]:
    redis.Redis.from_url(redis_server.url).flushall()
    settings = s3_settings(s3_server.endpoint_url, f"kvpool-test-{uuid.uuid4().hex[:12]}", redis_server.url)
    pool_env = {**env_for_pool(redis_server.url, settings, model, POOL_CHUNK), **env}
    pool = Pool(GatewayProcess(pool_env, free_port(), logs / "gateway.log"), {}, pool_env, redis_server.url, settings, logs)
    try:
        pool.workers.update({name: WorkerProcess(name, pool_env, logs / f"{name}.log") for name in workers})
        start_together([*pool.workers.values(), pool.gateway])
        yield pool
    finally:
        pool.gateway.stop()
        for w in pool.workers.values():
            w.kill()


@contextmanager
def private_pool(s3_server: S3Server, model: Path, logs: Path, workers: list[str], **env: str) -> Iterator[Pool]:
    """`running_pool` on a redis-server of its own: a pool many tests share, which no test's emptying of the session's Redis reaches."""
    with RedisServer(logs / "redis") as server, running_pool(server, s3_server, model, logs, workers, **env) as pool:
        yield pool


SHARED_TENANTS = 2000
"""API keys a shared pool's gateways know, one tenant each: more than the tests that use them."""


@dataclass
class SharedPool:
    """A pool many tests share, with a gateway per chat template; every test gets a tenant (an API key) of its own."""

    pool: Pool
    gateways: dict[str, GatewayProcess] = field(default_factory=dict)
    keys: Iterator[int] = field(default_factory=itertools.count)

    def tenancy(self, template: Path | None = None) -> Tenancy:
        """A fresh tenant on the gateway that renders chats with ``template`` (None: the model's own)."""
        name = str(template or "")
        if name not in self.gateways:
            env, log = {**self.pool.env, "KVPOOL_CHAT_TEMPLATE_FILE": name}, self.pool.logs / f"gateway{len(self.gateways)}.log"
            self.gateways[name] = GatewayProcess(env, free_port(), log).start() if template else self.pool.gateway
        key = next(self.keys)
        assert key < SHARED_TENANTS, "raise SHARED_TENANTS"
        return Tenancy(self.gateways[name].url, f"sk-test-{key}", self.pool.redis_url)


@contextmanager
def shared_pool(s3_server: S3Server, model: Path, logs: Path, workers: list[str], **env: str) -> Iterator[SharedPool]:
    """`private_pool` whose gateways know `SHARED_TENANTS` API keys."""
    keys = json.dumps({f"sk-test-{i}": f"test-{i}" for i in range(SHARED_TENANTS)})
    with private_pool(s3_server, model, logs, workers, KVPOOL_API_KEYS=keys, **env) as pool:
        shared = SharedPool(pool)
        try:
            yield shared
        finally:
            for g in shared.gateways.values():
                if g is not pool.gateway:
                    g.stop()


def counter(url: str, name: str, **labels: str) -> float:
    """A counter's value in the gateway's /metrics (0 before it first counts)."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def poll(done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Wait until ``done()`` (background work: a writer thread, a worker process), failing with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def in_one_round(loop: EngineLoop, *asks: Callable[[], object]) -> list[object]:
    """Run ``asks`` (decodes, each in a thread) in one round: the loop is held by a task until every one has queued."""
    running, gate = threading.Event(), threading.Event()
    out: list[object] = [None] * len(asks)

    def hold(llm: llama_cpp.Llama) -> None:
        running.set()
        gate.wait(30)

    def run(i: int) -> None:
        try:
            out[i] = asks[i]()
        except Exception as e:
            out[i] = e

    holder = threading.Thread(target=loop.run, args=(0, hold))
    holder.start()
    running.wait(30)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(asks))]
    for i, t in enumerate(threads, start=1):
        t.start()
        poll(lambda i=i: loop.pending() == i, "the request queued behind the held loop")
    gate.set()
    for t in [holder, *threads]:
        t.join(60)
    return out
