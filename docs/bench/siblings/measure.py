"""A prefix copied from a sibling sequence's cells against the same prefix restored from the store, and evaluated.

Run from the repository root: ``.kvpool/venv/bin/python docs/bench/siblings/measure.py``.
One worker context of two sequences (SmolLM2-135M-Instruct, f16 KV, 2 threads), a
folder store on local disk and a Redis of its own. For each prompt length, sequence 0
evaluates the prompt and publishes it; then sequence 1 is asked the prompt plus a few
tokens three ways: copying from sequence 0 (`worker.cache.siblings`), restoring from the store
(sequence 0's cells forgotten first), and cold (no store, nothing held). Printed: the
job's time to its first token and where its prompt came from, one JSON line each.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from gateway.pool.procs import RedisServer  # noqa: E402
from store.store import Store  # noqa: E402
from tests.helpers import prompt_text  # noqa: E402
from worker.answering import Engine  # noqa: E402
from worker.models.packaged import DEFAULT_MODEL, ensure_packaged  # noqa: E402
from worker.protocol import SamplingParams, job_spec  # noqa: E402
from worker.settings import PoolSettings, WorkerSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def ask(engine: Engine, tokens: list[int]) -> dict:
    spec = job_spec(tokens, model=engine.fingerprint, chunk_size=256, sampling=SamplingParams(max_tokens=1, temperature=0.0))
    t0 = time.perf_counter()
    r = engine.run(spec, lambda _e: True)
    engine.after_answer()
    u = r.usage
    return {
        "first_token_s": round(r.timings.first_token_s, 4),
        "wall_s": round(time.perf_counter() - t0, 4),
        "from_context": u.cached_from_context,
        "from_store": u.cached_from_store,
        "evaluated": u.evaluated_tokens,
    }


def main() -> None:
    model = ensure_packaged(DEFAULT_MODEL, ROOT / ".kvpool" / "models", PoolSettings().model_cache)
    with tempfile.TemporaryDirectory() as d, RedisServer(Path(d) / "redis") as redis:
        settings = WorkerSettings(redis_url=redis.url, store_url=str(Path(d) / "store"), n_ctx=4400, n_threads=2, parallel=2)
        engine = Engine(settings, model, store=Store.open(settings), name="m.0")
        other = engine.for_sequence(1, "m.1")
        cold = Engine(WorkerSettings(n_ctx=4400, n_threads=2), model, store=None, name="cold")
        try:
            for n in (1500, 4000):
                base = engine.llm.tokenize(prompt_text(n, 2 * n).encode())[:n]
                ask(engine, base)
                assert engine.publisher is not None and engine.publisher.wait_idle()
                for how in ("sibling_copy", "store_restore", "cold"):
                    prompt = [*base, *engine.llm.tokenize(f" Question {how}?".encode(), add_bos=False)]
                    other.forget_context()
                    if how == "store_restore":
                        engine.forget_context()
                    row = ask(cold if how == "cold" else other, prompt)
                    print(json.dumps({"prompt_tokens": len(prompt), "how": how, **row, "load": os.getloadavg()[0]}), flush=True)
                    if how == "sibling_copy":
                        ask(engine, base)  # sequence 0 holds it again for the next way
        finally:
            cold.close()
            other.close()
            engine.close()


if __name__ == "__main__":
    main()
