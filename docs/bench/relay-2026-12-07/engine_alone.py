"""Decode at four streams inside one worker's engine, no gateway, no Redis, no HTTP: what the pool's relay adds shows beside it.

Four job threads each answer a chat prompt with 256 greedy tokens at once through the
default worker's engine (`Engine.run`, each token event serialized as the job stream would),
2 threads, n_ctx 4096, as `kvpool bench-peers` starts the worker; two rounds. Printed: the
tokens per second, and each job thread's CPU (from /proc).

    python docs/bench/relay-2026-12-07/engine_alone.py MODEL.gguf
"""

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from worker.answering import Engine  # noqa: E402
from worker.protocol import SamplingParams, job_spec  # noqa: E402
from worker.settings import WorkerSettings  # noqa: E402

P, N = 4, 256
TCK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> float:
    f = Path(f"/proc/self/task/{threading.get_native_id()}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TCK


def answer(engines: list[Engine], chunk_size: int, i: int, *, cpu: list[float], tokens: list[int]) -> None:
    c0 = thread_cpu()
    prompt = f"<|im_start|>user\nTell story number {i + 1} about a lighthouse keeper, in great detail.<|im_end|>\n<|im_start|>assistant\n"
    spec = job_spec(
        engines[0].llm.tokenize(prompt.encode(), special=True),
        model=engines[0].fingerprint,
        chunk_size=chunk_size,
        sampling=SamplingParams(max_tokens=N, temperature=0.0),
    )
    tokens[i] = engines[i].run(spec, lambda e: bool(e.model_dump_json(exclude_none=True))).usage.completion_tokens
    engines[i].after_answer()
    cpu[i] = thread_cpu() - c0


def main() -> None:
    settings = WorkerSettings(n_ctx=4096, n_threads=2, parallel=P)
    engine = Engine.open(settings, Path(sys.argv[1]), store=None, name="alone.0")
    engines = [engine, *(engine.for_sequence(i, f"alone.{i}") for i in range(1, P))]
    for r in range(2):
        cpu, tokens = [0.0] * P, [0] * P
        t0 = time.perf_counter()
        with ThreadPoolExecutor(P) as pool:  # one thread per sequence, all submitted at once
            list(pool.map(partial(answer, engines, settings.chunk_size, cpu=cpu, tokens=tokens), range(P)))
        wall = time.perf_counter() - t0
        print(
            f"round {r}: {sum(tokens)} tokens in {wall:.2f} s, {sum(tokens) / wall:.1f} tokens/s; job threads' CPU {[round(c, 2) for c in cpu]} s",
            flush=True,
        )
    for e in reversed(engines):
        e.close()


if __name__ == "__main__":
    main()
