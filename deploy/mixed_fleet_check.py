"""The driver of ``deploy/mixed-fleet-check.sh``: two builds of llama-cpp-python in one pool, each answering as its own cold run.

Run by the script with the first virtualenv's Python, kvpool's code taken from this
repository (``PYTHONPATH``); ``--python-b`` is the Python of the second build's
virtualenv. Phases:

1. **fingerprints**: each build's kernel fingerprint (`worker.kernels`) as its own
   Python reads it, and as its worker advertises it: the two must differ.
2. **cold**: a worker of each build alone, with a Redis database and a store of its own
   and publishing off, answers every prompt from an empty context: the reference.
3. **mixed** (``KVPOOL_SHARE_ACROSS_KERNELS=false``, the default): one worker of each
   build against one Redis and one store. For each document one build answers first and
   publishes; then the other answers the same prompt and another question on the same
   document, and the first answers that one too; for the next document the roles swap.
   Every answer must be its own build's cold answer (the tokens, and the logprob of
   every token and the first token's top 5, to the bit), and no worker may restore
   anything the other build published.
4. **shared** (informational, ``--shared``): the same with
   ``KVPOOL_SHARE_ACROSS_KERNELS=true`` on both: how many answers then differ from cold,
   and how many tokens were restored across builds.

Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import redis

from gateway.pool.procs import RedisServer, WorkerProcess
from store.fingerprint import fingerprint_file
from worker.advert import adverts
from worker.client import events, submit
from worker.protocol import DoneEvent, ErrorEvent, JobResult, SamplingParams, TokenEvent, job_spec, worker_queue

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 64
WORDS = "the a of and to in is was for on that with as by at from river mountain signal engine memory garden window".split()
WORDS += "silver letter market winter harbor lantern keeper bridge orchard station ferry clock tower north south".split()
QUESTIONS = ["Where is the harbor lantern?", "Who keeps the orchard in winter?"]


class BuildWorker(WorkerProcess):
    """A ``kvpool worker`` run by a given virtualenv's Python, on this repository's code."""

    def __init__(self, name: str, python: str, env: dict[str, str], log: Path, redis_url: str) -> None:
        super().__init__(name, {**env, "PYTHONPATH": str(ROOT)}, log, redis_url)
        self.python = python

    def args(self) -> list[str]:
        return [self.python, "-c", "from gateway.cli import main; main()", "worker"]


@dataclass(frozen=True)
class Answer:
    tokens: list[int]
    logprobs: list[float]
    top: dict[str, float]
    restored: int
    worker: str

    def same_bits(self, other: Answer) -> bool:
        return (self.tokens, self.logprobs, self.top) == (other.tokens, other.logprobs, other.top)


class Pool:
    def __init__(self, url: str, model: Path) -> None:
        self.conn = redis.Redis.from_url(url)
        self.model = fingerprint_file(model)

    def ask(self, worker: str, tokens: list[int], *, tenant: str = "", max_tokens: int = 16) -> Answer:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5)
        spec = job_spec(tokens, model=self.model, chunk_size=CHUNK, tenant_salt=tenant, sampling=sampling)
        job = submit(self.conn, spec, queue=worker_queue(worker), attempts=1)
        result: JobResult | None = None
        first: dict[str, float] = {}
        for ev in events(self.conn, job.id, timeout_s=300):
            if isinstance(ev, TokenEvent) and not first:
                first = dict(ev.top_logprobs or {})
            elif isinstance(ev, DoneEvent):
                result = ev.result
            elif isinstance(ev, ErrorEvent):
                raise RuntimeError(f"job on {worker} failed: {ev.error}")
        assert result is not None
        return Answer(result.tokens, list(result.logprobs or []), first, result.usage.cached_from_store, result.worker)

    def ask_cold(self, worker: str, name: str, tokens: list[int]) -> Answer:
        """Ask from an empty context (a job of another tenant first, which this one may not reuse).

        Each document is its own tenant, so what a worker restores of it can only come
        from this document's chunks, never from the other document's first tokens.
        """
        self.ask(worker, [1, 2, 3], tenant="mixed-fleet-flush", max_tokens=1)
        return self.ask(worker, tokens, tenant=name.split("-")[0])

    def settle(self, timeout_s: float = 120.0) -> None:
        """Until every worker is idle with nothing left to publish."""
        deadline = time.monotonic() + timeout_s
        while not all(not a.busy and a.pending == 0 for a in adverts(self.conn)):
            if time.monotonic() > deadline:
                raise TimeoutError("workers still busy or publishing")
            time.sleep(0.1)

    def kernels(self) -> dict[str, str]:
        return {a.worker: a.kernels for a in adverts(self.conn)}


def prompts(model: Path, words: int) -> dict[str, list[int]]:
    """Two documents of ``words`` words (520: about 540 tokens), two questions on each, in a ChatML chat (SmolLM2's template)."""
    vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    out = {}
    for d in range(2):
        doc = " ".join(WORDS[(7 * i * i + 3 * i + 11 * d) % len(WORDS)] for i in range(words))
        for q, question in enumerate(QUESTIONS):
            text = f"<|im_start|>system\n{doc}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
            out[f"doc{d}-q{q}"] = vocab.tokenize(text.encode(), special=True)
    return out


def read_fingerprint(python: str, env: dict[str, str]) -> str:
    code = "from worker.kernels import library_fingerprint; print(library_fingerprint().canonical())"
    out = subprocess.run([python, "-c", code], env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{python} could not read its kernel fingerprint:\n{out.stderr}")
    return out.stdout.strip()


@contextmanager
def workers(builds: dict[str, tuple[str, dict[str, str]]], url: str, store: Path, logs: Path, **env: str) -> Iterator[Pool]:
    base = {
        "KVPOOL_REDIS_URL": url,
        "KVPOOL_STORE_URL": str(store),
        "KVPOOL_CHUNK_SIZE": str(CHUNK),
        "KVPOOL_N_CTX": "2048",
        "KVPOOL_N_THREADS": "1",
        "KVPOOL_HEARTBEAT_S": "0.5",
        "KVPOOL_SETTLE_IDLE_S": "0",
        **env,
    }
    procs = []
    try:
        for name, (python, extra) in builds.items():
            procs.append(BuildWorker(name, python, {**base, **extra}, logs / f"{name}-{store.name}.log", url).start(timeout_s=300))
        yield Pool(url, Path(base["KVPOOL_MODEL"]))
    finally:
        for p in procs:
            p.stop()


class Checks:
    def __init__(self) -> None:
        self.failed = 0

    def check(self, ok: bool, what: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
        self.failed += not ok


Cold = dict[str, dict[str, Answer]]


def mixed_round(
    pool: Pool, prompts: dict[str, list[int]], cold: Cold, doc: int, order: tuple[str, str], exact: bool, checks: Checks
) -> int:
    """One document: ``order[0]`` publishes, ``order[1]`` follows; returns how many answers differed from cold."""
    first, second = order
    q0, q1 = f"doc{doc}-q0", f"doc{doc}-q1"
    plan = [(first, q0), (second, q0), (second, q1), (first, q1)]
    differ = 0
    for step, (worker, name) in enumerate(plan):
        answer = pool.ask_cold(worker, name, prompts[name])
        pool.settle()
        same = answer.same_bits(cold[worker][name])
        differ += not same
        what = f"{name} on {worker} ({'published first' if worker == first else 'after ' + first}): restored {answer.restored} tokens"
        if exact:
            checks.check(same, f"{what}, the cold answer to the bit")
            if step == 1:
                checks.check(answer.restored == 0, f"{name} on {worker}: nothing restored of what {first} published")
        else:
            print(f"info {what}, {'the cold answer' if same else 'NOT the cold answer'}", flush=True)
    return differ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python-a", default=sys.executable, help="Python of the first build (default: this one)")
    ap.add_argument("--python-b", required=True, help="Python of the second build")
    ap.add_argument("--env-b", default="", help="extra environment of the second build's worker, as NAME=VALUE,...")
    ap.add_argument("--model", required=True, help="the GGUF model")
    ap.add_argument("--shared", action="store_true", help="also run the informational phase with sharing across kernels")
    ap.add_argument("--doc-words", type=int, default=520, help="words per document (520: about 540 tokens per prompt)")
    args = ap.parse_args()
    env_b = dict(kv.split("=", 1) for kv in args.env_b.split(",") if kv)
    builds = {"a": (args.python_a, {}), "b": (args.python_b, env_b)}
    model = Path(args.model).resolve()
    asked = prompts(model, args.doc_words)
    checks = Checks()

    prints = {name: read_fingerprint(python, extra) for name, (python, extra) in builds.items()}
    for name, fp in prints.items():
        print(f"kernels of build {name}: {fp}")
    checks.check(prints["a"] != prints["b"], "the two builds' kernel fingerprints differ")
    if prints["a"] == prints["b"]:
        print(
            "the second build computes with the same kernels as the first on this machine (a host without AVX-512 builds "
            "AVX2 natively): build another second one, e.g. MIXED_FLEET_NAME=nollamafile MIXED_FLEET_CMAKE_ARGS='-DGGML_LLAMAFILE=OFF'"
        )
        return 1

    with tempfile.TemporaryDirectory(prefix="kvpool-mixed-") as tmp, RedisServer(Path(tmp) / "redis") as server:
        tmpdir, url = Path(tmp), server.url.removesuffix("/0")
        cold: dict[str, dict[str, Answer]] = {}
        for db, name in enumerate(builds, start=1):
            with workers(
                {name: builds[name]}, f"{url}/{db}", tmpdir / f"cold-{name}", tmpdir, KVPOOL_MODEL=str(model), KVPOOL_PUBLISH="false"
            ) as pool:
                cold[name] = {p: pool.ask_cold(name, p, tokens) for p, tokens in asked.items()}
                checks.check(all(a.restored == 0 for a in cold[name].values()), f"build {name}'s cold answers restored nothing")
        diff = sum(not cold["a"][p].same_bits(cold["b"][p]) for p in asked)
        print(f"info the builds' cold answers differ on {diff} of {len(asked)} prompts (tokens or logprobs)")

        with workers(builds, f"{url}/3", tmpdir / "mixed", tmpdir, KVPOOL_MODEL=str(model)) as pool:
            advertised = pool.kernels()
            checks.check(advertised == prints, "each worker advertises its build's kernel fingerprint")
            mixed_round(pool, asked, cold, 0, ("a", "b"), True, checks)
            mixed_round(pool, asked, cold, 1, ("b", "a"), True, checks)

        if args.shared:
            with workers(
                builds, f"{url}/4", tmpdir / "shared", tmpdir, KVPOOL_MODEL=str(model), KVPOOL_SHARE_ACROSS_KERNELS="true"
            ) as pool:
                differ = mixed_round(pool, asked, cold, 0, ("a", "b"), False, checks)
                differ += mixed_round(pool, asked, cold, 1, ("b", "a"), False, checks)
                print(f"info sharing across kernels: {differ} of 8 answers differ from their build's cold answer")

    print(json.dumps({"failed": checks.failed, "kernels": prints}))
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
