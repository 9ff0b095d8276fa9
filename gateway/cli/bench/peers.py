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
  folder store, gateway) with one worker of all threads, or two of half each.

Workloads, as chat requests on the real model:

* ``W1`` a long shared system prompt and distinct questions;
* ``W3`` several documents, each asked several questions, the documents alternating.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from gateway.cli.procs import LlamaServer, free_port

MAX_TOKENS = 32


@dataclass(frozen=True)
class Workload:
    key: str
    title: str
    bodies: tuple[str, ...]
    """JSON request bodies (chat, streaming), in the order they are sent."""


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

    @property
    def ttft_p50(self) -> float:
        return statistics.median(self.ttft_s)

    @property
    def ttft_p95(self) -> float:
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def _text(repo: Path) -> list[str]:
    words: list[str] = []
    for path in [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]:
        words += path.read_text().split()
    return words


def _chat(model: str, system: str, question: str, max_tokens: int = MAX_TOKENS) -> str:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body)


def workloads(repo: Path, model: str, *, prefix_words: int = 1100, doc_words: int = 450) -> list[Workload]:
    words = _text(repo)
    shared = " ".join(words[:prefix_words])
    w1 = tuple(_chat(model, shared, f"In one sentence: what does part {i + 1} of this text say?") for i in range(12))
    docs = [" ".join(words[prefix_words + i * doc_words : prefix_words + (i + 1) * doc_words]) for i in range(4)]
    asks = ["Summarise this document.", "Name one tool it mentions.", "What problem does it solve?", "Who would use it?"]
    w3 = tuple(_chat(model, doc, q) for q in asks for doc in docs)
    return [Workload("W1", "shared system prompt, 12 questions", w1), Workload("W3", "4 documents x 4 questions, alternating", w3)]


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
    ttft, text, usage = None, "", {}
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


def run_workload(system: str, urls: list[str], wl: Workload, concurrency: int) -> RunResult:
    """Send ``wl``'s requests with ``concurrency`` clients; requests go to ``urls`` in turn."""
    out = RunResult(system, wl.key, concurrency, 0.0)
    answers: list[str] = [""] * len(wl.bodies)
    ttfts: list[float] = [0.0] * len(wl.bodies)
    next_i = iter(range(len(wl.bodies)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            with httpx.Client(timeout=600) as c:  # a connection per request: llama-server's HTTP server caps keep-alive
                reply = _stream(c, urls[i % len(urls)], wl.bodies[i])
            ttfts[i], answers[i] = reply.ttft_s, reply.text
            with lock:
                out.prompt_tokens += reply.prompt
                out.cached_tokens += reply.cached
                out.completion_tokens += reply.completion

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.wall_s = time.perf_counter() - t0
    out.ttft_s, out.answers = ttfts, answers
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


@contextmanager
def kvpool_pool(model: Path, *, workers: int, threads: int, n_ctx: int, logs: Path) -> Iterator[list[str]]:
    from gateway.cli.up import LocalPool
    from gateway.settings import GatewaySettings

    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as state:
        env_keep = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith("KVPOOL_")]}
        os.environ.update({"KVPOOL_N_CTX": str(n_ctx), "KVPOOL_STATE_DIR": state})
        pool = LocalPool(GatewaySettings(model=str(model), port=free_port()), workers=workers, threads=threads, say=lambda _: None)
        try:
            gateway = pool.start()
            yield [gateway.url]
        finally:
            pool.stop()
            for k in ("KVPOOL_N_CTX", "KVPOOL_STATE_DIR"):
                os.environ.pop(k, None)
            os.environ.update(env_keep)


def systems(binary: Path | None, model: Path, *, threads: int, n_ctx: int, logs: Path) -> dict[str, Callable[[], object]]:
    found: dict[str, Callable[[], object]] = {}
    if binary is not None:
        found["llama-server 1 slot"] = lambda: llama_servers(binary, model, count=1, threads=threads, slots=1, n_ctx=n_ctx, logs=logs)
        found["llama-server 4 slots"] = lambda: llama_servers(binary, model, count=1, threads=threads, slots=4, n_ctx=n_ctx, logs=logs)
        found["2 llama-servers, round-robin"] = lambda: llama_servers(
            binary, model, count=2, threads=max(1, threads // 2), slots=1, n_ctx=n_ctx, logs=logs
        )
    found[f"kvpool 1w x {threads}t"] = lambda: kvpool_pool(model, workers=1, threads=threads, n_ctx=n_ctx, logs=logs)
    found[f"kvpool 2w x {max(1, threads // 2)}t"] = lambda: kvpool_pool(
        model, workers=2, threads=max(1, threads // 2), n_ctx=n_ctx, logs=logs
    )
    return found


def decode_run(system: str, urls: list[str], model: str, *, requests: int = 8, concurrency: int = 4, max_tokens: int = 128) -> RunResult:
    """Decode throughput: short prompts, long answers; tokens are counted from each reply's usage."""
    bodies = tuple(
        _chat(model, "You are a storyteller.", f"Tell story number {i + 1} about a lighthouse keeper.", max_tokens) for i in range(requests)
    )
    return run_workload(system, urls, Workload("decode", f"{requests} x {max_tokens} tokens", bodies), concurrency)


def run_peers(
    binary: Path | None, model: Path, model_name: str, repo: Path, *, threads: int, n_ctx: int, logs: Path, echo: Callable[[str], None]
) -> dict[str, object]:
    results: list[RunResult] = []
    decode: list[dict[str, object]] = []
    wls = workloads(repo, model_name)
    warm = _chat(model_name, "You are terse.", "Say hello.")
    for name, start in systems(binary, model, threads=threads, n_ctx=n_ctx, logs=logs).items():
        for wl in wls:
            for conc in (1, 4):
                with start() as urls:  # type: ignore[attr-defined]
                    for url in urls:
                        with httpx.Client(timeout=600) as c:
                            _stream(c, url, warm)
                    r = run_workload(name, urls, wl, conc)
                results.append(r)
                echo(
                    f"{name:32s} {wl.key} c={conc}: wall {r.wall_s:6.2f} s, TTFT p50 {r.ttft_p50 * 1000:7.1f} ms, cached {r.cached_tokens}/{r.prompt_tokens}"
                )
        with start() as urls:  # type: ignore[attr-defined]
            for url in urls:
                with httpx.Client(timeout=600) as c:
                    _stream(c, url, warm)
            d = decode_run(name, urls, model_name)
        decode.append(
            {"system": name, "wall_s": d.wall_s, "completion_tokens": d.completion_tokens, "tokens_per_s": d.completion_tokens / d.wall_s}
        )
        echo(f"{name:32s} decode: {d.completion_tokens} tokens in {d.wall_s:6.2f} s ({d.completion_tokens / d.wall_s:.0f} tokens/s)")
    return {
        "threads": threads,
        "n_ctx": n_ctx,
        "model": model_name,
        "runs": [asdict(r) | {"ttft_p50": r.ttft_p50, "ttft_p95": r.ttft_p95} for r in results],
        "decode": decode,
    }


def report(doc: dict[str, object], command: str) -> str:
    """Markdown: one table per workload and concurrency, with ratios to llama-server's single slot."""
    runs = doc["runs"]  # type: ignore[index]
    lines = [
        f"Model {doc['model']}, {doc['threads']} threads in all per system, context {doc['n_ctx']} per slot.",
        "",
        f"Command: `{command}`",
        "",
    ]
    for key in sorted({r["workload"] for r in runs}):  # type: ignore[index]
        for conc in (1, 4):
            rows = [r for r in runs if r["workload"] == key and r["concurrency"] == conc]  # type: ignore[index]
            base = next((r for r in rows if r["system"] == "llama-server 1 slot"), None)
            lines += [
                f"### {key}, concurrency {conc}",
                "",
                "| system | wall s | TTFT p50 ms | TTFT p95 ms | cached / prompt tokens | wall vs llama-server 1 slot | TTFT p50 vs llama-server 1 slot |",
                "|---|---|---|---|---|---|---|",
            ]
            for r in rows:
                ratio = (f"{base['wall_s'] / r['wall_s']:.2f}x", f"{base['ttft_p50'] / r['ttft_p50']:.2f}x") if base else ("-", "-")
                lines.append(
                    f"| {r['system']} | {r['wall_s']:.2f} | {r['ttft_p50'] * 1000:.0f} | {r['ttft_p95'] * 1000:.0f} | "
                    f"{r['cached_tokens']} / {r['prompt_tokens']} | {ratio[0]} | {ratio[1]} |"
                )
            lines.append("")
    lines += ["### decode, 8 requests at concurrency 4", "", "| system | tokens | wall s | tokens/s |", "|---|---|---|---|"]
    for d in doc["decode"]:  # type: ignore[union-attr]
        lines.append(f"| {d['system']} | {d['completion_tokens']} | {d['wall_s']:.2f} | {d['tokens_per_s']:.0f} |")
    lines.append("")
    lines.append("Ratios above 1 mean faster than llama-server with one slot.")
    return "\n".join(lines) + "\n"
