"""kvpool beside llama.cpp's own ``llama-server``, over the same OpenAI HTTP API, in one run.

Every system gets the same model, the same threads in all, the same chat prompts and
greedy decoding, and is started afresh (empty caches) for each workload and concurrency,
then warmed up with one unrelated request. Times are the client's: time to first token
from a streamed response, and the wall time of the whole run.

Systems:

* ``llama-server 1 slot`` and ``llama-server 4 slots`` (``-np``, default ``--cache-ram``);
* ``2 llama-servers, round-robin``: two servers of half the threads each, requests
  alternating between them -- scaling out without a shared cache;
* ``kvpool 1w x 2t`` and ``kvpool 2w x 1t``: ``kvpool up``'s pool (managed Redis,
  folder store, gateway) with one worker of all threads, or two of half each;
* ``kvpool 1w x 2t x 4 seq``: one worker of all threads serving 4 sequences at once
  (``KVPOOL_PARALLEL=4``), llama-server 4 slots' counterpart.

Workloads: `peer_workloads` (W1 to W4, chat requests of real text). The report is
`peers_report`.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from gateway.pool.bench.peer_workloads import KEYS, Workload, chat_body, workloads
from gateway.pool.procs import LlamaServer, busy_neighbour, free_port
from gateway.settings import GatewaySettings


@dataclass
class RunResult:
    system: str
    workload: str
    concurrency: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    answers: list[str] = field(default_factory=list)
    neighbour: bool = False
    """Run while a busy loop held one of the system's cores (``--neighbour``)."""

    @property
    def ttft_p50(self) -> float:
        return statistics.median(self.ttft_s)

    @property
    def ttft_p95(self) -> float:
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


@dataclass
class Reply:
    ttft_s: float
    text: str
    prompt: int = 0
    cached: int = 0
    completion: int = 0


def _stream(client: httpx.Client, url: str, body: str) -> Reply:
    """One streamed chat request, timed from the client."""
    t0 = time.perf_counter()
    ttft, text = None, ""
    usage: dict[str, Any] = {}
    with client.stream("POST", url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            for choice in doc.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
            usage = doc.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    ttft = ttft if ttft is not None else time.perf_counter() - t0
    return Reply(ttft, text, usage.get("prompt_tokens", 0), cached, usage.get("completion_tokens", 0))


def _send(urls: list[str], bodies: list[str], first: int, concurrency: int, out: RunResult) -> list[Reply]:
    """Send ``bodies`` with ``concurrency`` clients; request ``first + i`` goes to ``urls[(first + i) % len(urls)]``."""
    replies: list[Reply | None] = [None] * len(bodies)
    next_i = iter(range(len(bodies)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            with httpx.Client(timeout=600) as c:  # a connection per request: llama-server's HTTP server caps keep-alive
                replies[i] = _stream(c, urls[(first + i) % len(urls)], bodies[i])

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in replies if r is not None]
    assert len(done) == len(bodies), "a client thread failed"
    for r in done:
        out.ttft_s.append(r.ttft_s)
        out.answers.append(r.text)
        out.prompt_tokens += r.prompt
        out.cached_tokens += r.cached
        out.completion_tokens += r.completion
    return done


def run_workload(system: str, urls: list[str], wl: Workload, concurrency: int) -> RunResult:
    """Send ``wl``'s requests with ``concurrency`` clients; requests go to ``urls`` in turn.

    A chat workload is sent one turn at a time: the next turn of every chat once the
    previous turn of every chat is answered, with the answers the system gave.
    """
    out = RunResult(system, wl.key, concurrency, 0.0)
    t0 = time.perf_counter()
    if wl.bodies:
        _send(urls, list(wl.bodies), 0, concurrency, out)
    answers: list[list[str]] = [[] for _ in wl.chats]
    for turn in range(max((len(c.questions) for c in wl.chats), default=0)):
        bodies = [c.body(answers[i]) for i, c in enumerate(wl.chats)]
        for i, reply in enumerate(_send(urls, bodies, turn * len(wl.chats), concurrency, out)):
            answers[i].append(reply.text)
    out.wall_s = time.perf_counter() - t0
    return out


@contextmanager
def llama_servers(binary: Path, model: Path, *, count: int, threads: int, slots: int, n_ctx: int, logs: Path) -> Iterator[list[str]]:
    args = ["-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx * slots), "-np", str(slots)]
    servers = [LlamaServer(binary, args, logs / f"llama-server-{count}x{slots}-{i}.log") for i in range(count)]
    try:
        for server in servers:
            server.spawn()
        for server in servers:
            server.wait_ready()
        yield [server.url for server in servers]
    finally:
        for server in servers:
            server.stop()


class BenchPoolSettings(GatewaySettings):
    """A benchmarked pool's settings: the values given and the defaults, never a ``KVPOOL_*`` variable of this process."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


@contextmanager
def kvpool_pool(model: Path, *, workers: int, threads: int, n_ctx: int, logs: Path, parallel: int = 1) -> Iterator[list[str]]:
    """A kvpool pool of its own (managed Redis, a fresh store) whatever ``KVPOOL_*`` variables this process has.

    ``parallel``: each worker's ``KVPOOL_PARALLEL`` (0: the default, the worker chooses by its model).
    """
    from gateway.pool.up import LocalPool

    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as state:
        settings = BenchPoolSettings(model=str(model), port=free_port(), n_ctx=n_ctx, state_dir=Path(state))
        pool = LocalPool(
            settings,
            workers=workers,
            threads=threads,
            say=lambda _: None,
            inherit_settings=False,
            worker_env={"KVPOOL_PARALLEL": str(parallel)},
        )
        try:
            gateway = pool.start()
            yield [gateway.url]
        finally:
            pool.stop()


SYSTEMS = ("server-1", "server-4", "round-robin", "kvpool", "kvpool-1w", "kvpool-1w4s", "kvpool-2w")
"""The systems' short names, as ``--systems`` takes them, in the order they run."""


def systems(
    binary: Path | None, model: Path, *, threads: int, n_ctx: int, logs: Path, only: tuple[str, ...] = SYSTEMS
) -> dict[str, Callable[[], object]]:
    """Each system's report name and how to start it: those of ``only`` (llama-server's only with a binary)."""
    found: dict[str, tuple[str, Callable[[], object]]] = {}
    half = max(1, threads // 2)
    if binary is not None:
        found["server-1"] = (
            "llama-server 1 slot",
            lambda: llama_servers(binary, model, count=1, threads=threads, slots=1, n_ctx=n_ctx, logs=logs),
        )
        found["server-4"] = (
            "llama-server 4 slots",
            lambda: llama_servers(binary, model, count=1, threads=threads, slots=4, n_ctx=n_ctx, logs=logs),
        )
        found["round-robin"] = (
            "2 llama-servers, round-robin",
            lambda: llama_servers(binary, model, count=2, threads=half, slots=1, n_ctx=n_ctx, logs=logs),
        )
    found["kvpool"] = (
        f"kvpool 1w x {threads}t, defaults",
        lambda: kvpool_pool(model, workers=1, threads=threads, n_ctx=n_ctx, logs=logs, parallel=0),
    )
    found["kvpool-1w"] = (f"kvpool 1w x {threads}t", lambda: kvpool_pool(model, workers=1, threads=threads, n_ctx=n_ctx, logs=logs))
    found["kvpool-1w4s"] = (
        f"kvpool 1w x {threads}t x 4 seq",
        lambda: kvpool_pool(model, workers=1, threads=threads, n_ctx=n_ctx, logs=logs, parallel=4),
    )
    found["kvpool-2w"] = (f"kvpool 2w x {half}t", lambda: kvpool_pool(model, workers=2, threads=half, n_ctx=n_ctx, logs=logs))
    return {name: start for key, (name, start) in found.items() if key in only}


def decode_run(
    system: str, urls: list[str], model: str, *, requests: int = 8, concurrency: int = 4, max_tokens: int = 128, stop: tuple[str, ...] = ()
) -> RunResult:
    """Decode throughput: short prompts, long answers; tokens are counted from each reply's usage."""
    bodies = tuple(
        chat_body(model, "You are a storyteller.", f"Tell story number {i + 1} about a lighthouse keeper.", max_tokens, stop)
        for i in range(requests)
    )
    return run_workload(system, urls, Workload("decode", f"{requests} x {max_tokens} tokens", bodies), concurrency)


def template_stops(model: Path) -> tuple[str, ...]:
    """The end-of-turn text of the chat template both servers render for ``model``, sent as every request's stop string.

    A GGUF without a template (Gemma 3 270M's) is rendered as ChatML by both servers, and
    ChatML's ``<|im_end|>`` is then ordinary text to the model: kvpool ends an answer there
    (`gateway.tokenizer.Tokenizer.chat_stops`), llama-server writes on to ``max_tokens``
    unless told. Asking both to stop there makes their answers end alike; where the text
    is a special token (SmolLM2's) the model's end of generation ends both answers already.
    """
    from gateway.tokenizer import Tokenizer  # a vocabulary-only load of the model

    return tuple(Tokenizer(model).chat_stops)


def _warm_up(urls: list[str], model: str) -> None:
    """One unrelated request per server, so no system pays its first-request costs inside a measurement."""
    for url in urls:
        with httpx.Client(timeout=600) as c:
            _stream(c, url, chat_body(model, "You are terse.", "Say hello."))


def run_peers(
    binary: Path | None,
    model: Path,
    model_name: str,
    repo: Path,
    *,
    threads: int,
    n_ctx: int,
    logs: Path,
    echo: Callable[[str], None],
    keys: tuple[str, ...] = KEYS,
    concurrencies: tuple[int, ...] = (1, 4),
    only: tuple[str, ...] = SYSTEMS,
    neighbour: bool = False,
    decode_run_too: bool = True,
) -> dict[str, object]:
    """Every system on every workload and concurrency, each started afresh (empty caches), then decode throughput.

    With ``neighbour``, each run is repeated right after with a busy loop on one of the cores (`busy_neighbour`).
    """
    results: list[RunResult] = []
    decode: list[dict[str, object]] = []
    stop = template_stops(model)
    wls = workloads(repo, model_name, keys, stop=stop)
    for name, start in systems(binary, model, threads=threads, n_ctx=n_ctx, logs=logs, only=only).items():
        for wl in wls:
            for conc in concurrencies:
                for busy in (False, True) if neighbour else (False,):
                    with start() as urls:  # type: ignore[attr-defined]
                        _warm_up(urls, model_name)
                        with busy_neighbour() if busy else nullcontext():
                            r = run_workload(name, urls, wl, conc)
                    r.neighbour = busy
                    results.append(r)
                    echo(
                        f"{name + (' + neighbour' if busy else ''):30s} {wl.key} c={conc}: wall {r.wall_s:6.2f} s, "
                        f"TTFT p50 {r.ttft_p50 * 1000:7.1f} ms, cached {r.cached_tokens}/{r.prompt_tokens}, completion {r.completion_tokens}"
                    )
        if not decode_run_too:
            continue
        with start() as urls:  # type: ignore[attr-defined]
            _warm_up(urls, model_name)
            d = decode_run(name, urls, model_name, stop=stop)
        decode.append(
            {"system": name, "wall_s": d.wall_s, "completion_tokens": d.completion_tokens, "tokens_per_s": d.completion_tokens / d.wall_s}
        )
        echo(f"{name:30s} decode: {d.completion_tokens} tokens in {d.wall_s:6.2f} s ({d.completion_tokens / d.wall_s:.0f} tokens/s)")
    return {
        "threads": threads,
        "neighbour": neighbour,
        "n_ctx": n_ctx,
        "model": model_name,
        "stop": list(stop),
        "workloads": {w.key: w.title for w in wls},
        "runs": [asdict(r) | {"ttft_p50": r.ttft_p50, "ttft_p95": r.ttft_p95} for r in results],
        "decode": decode,
    }
