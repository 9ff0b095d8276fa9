"""Four sequences of one worker's context decoding greedily at once, in one process, no gateway, no Redis.

Each round: four engines (job threads) answer a short prompt with up to N greedy tokens at once
(`Engine.run`, every token event serialized as the job stream would), then a loop task decodes the
same number of bare 4-row steps (`llama_decode` alone). The difference per step is what the
engine's threads, sampling and events cost beside the kernels.

    python docs/bench/defaults-2026-12-07/steps4.py MODEL.gguf [N]
"""

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import llama_cpp

from worker.answering import Engine
from worker.protocol import SamplingParams, job_spec
from worker.settings import WorkerSettings

model = Path(sys.argv[1])
P = 4
N = int(sys.argv[2]) if len(sys.argv) > 2 else 128
settings = WorkerSettings(n_ctx=1024, n_threads=2, parallel=P)
engine = Engine.open(settings, model, store=None, name="p.0")
engines = [engine, *(engine.for_sequence(i, f"p.{i}") for i in range(1, P))]


def run_engines(tag):
    outs = [None] * P

    def one(i):
        toks = engine.llm.tokenize(f"Tell story number {i + 1} about a lighthouse keeper {tag}.".encode())
        spec = job_spec(
            toks, model=engine.fingerprint, chunk_size=settings.chunk_size, sampling=SamplingParams(max_tokens=N, temperature=0.0)
        )
        n = [0]

        def emit(e):
            e.model_dump_json(exclude_none=True)
            n[0] += 1
            return True

        r = engines[i].run(spec, emit)
        engines[i].after_answer()
        outs[i] = r.usage.completion_tokens

    ts = [threading.Thread(target=one, args=(i,)) for i in range(P)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    return outs, dt


loop = engine.loaded.context.loop


def bare(n_steps):
    def task(llm):
        mem = llama_cpp.llama_get_memory(llm.ctx)
        ends = [llama_cpp.llama_memory_seq_pos_max(mem, s) + 1 for s in range(P)]
        t0 = time.perf_counter()
        for k in range(n_steps):
            i = 0
            for s in range(P):
                i = loop._put(i, s, [100 + k % 50], ends[s] + k, logits=False, last=True)
            loop._batch.n_tokens = i
            assert llama_cpp.llama_decode(llm.ctx, loop._batch) == 0
            for s in range(P):
                llama_cpp.llama_get_logits_ith(llm.ctx, s)
        dt = time.perf_counter() - t0
        for s in range(P):
            llama_cpp.llama_memory_seq_rm(mem, s, ends[s], -1)
        return dt

    return loop.run(0, task)


for r in range(3):
    rounds, gathered = loop.rounds, loop.gathered_s
    counts, dt = run_engines("r0")  # the same four prompts each round: all four reach N tokens
    per_step = f"{1000 * dt / max(counts):.2f} ms per step" if min(counts) == N else "sequences ended early: not comparable"
    print(
        f"round {r}: engines {counts} tokens in {dt:.2f} s, {per_step}; "
        f"loop rounds {loop.rounds - rounds}, waiting for job threads {loop.gathered_s - gathered:.3f} s",
        flush=True,
    )
    dt = bare(N)
    print(f"round {r}: bare 4-row calls: {1000 * dt / N:.2f} ms per step", flush=True)
for e in reversed(engines):
    e.close()
