"""Gemma 3 270M: the bytes a long agent session leaves in the store, with the checkpoint spacing of today or of before.

One conversation of TURNS turns grows to about TARGET tokens: each turn resends the whole
history (the last prompt, the answer, then a new user message), as an agent does. Every
turn runs on an engine whose context was forgotten, as if another worker of the pool
took it, so it resumes from the store's checkpoints. At the end it reports the bytes
and blobs the store holds, and each checkpoint's size by position (to extrapolate).

``before`` replays the spacing kvpool had until this change, in this script only: a
checkpoint at every chunk boundary (``KVPOOL_CHECKPOINT_EVERY=1``) and no superseding.

    python docs/bench/checkpoints-gemma3/agent_session.py MODEL OUT_DIR TARGET TURNS {spaced,before}
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import store.checkpoints
import worker.answering
from gateway.pool.procs import RedisServer
from store.store import Store
from tests.helpers import prompt_text
from worker.answering import Engine
from worker.protocol import SamplingParams, job_spec
from worker.settings import WorkerSettings

CHUNK = 256
model, out_dir, target, turns, policy = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
out_dir.mkdir(parents=True, exist_ok=True)


def every_boundary(start: int, n: int, chunk_size: int, every: int, n_swa: int = 0, hints: list[int] | tuple[int, ...] = ()) -> list[int]:
    """The spacing before: every ``every``-th boundary (as `worker.cache.checkpoints.checkpoint_stops` did), hints and the end."""
    from worker.cache.checkpoints import WINDOW_ALIGN, aligned

    c = chunk_size
    stops = {d * c for d in range(start // c + 1, (n - 2) // c + 1) if d % every == 0 and aligned(d * c, n_swa)}
    for want in [*hints, n - 2]:
        pos = want - (want - n_swa) % WINDOW_ALIGN if n_swa and want > n_swa else want
        if start < pos <= n - 2 and all(abs(pos - s) >= 2 for s in stops | {start}):
            stops.add(pos)
    return sorted(stops)


if policy == "before":
    worker.answering.checkpoint_stops = every_boundary  # type: ignore[assignment]
    store.checkpoints.Checkpoints.supersede = lambda self, *a: 0  # type: ignore[method-assign]

with tempfile.TemporaryDirectory(dir="/tmp") as tmp, RedisServer(Path(tmp) / "redis") as rs:
    settings = WorkerSettings(
        redis_url=rs.url,
        store_url=str(Path(tmp) / "store"),
        store_max_bytes=10**13,  # no eviction: count what the policy leaves
        chunk_size=CHUNK,
        n_ctx=target + 2048,
        n_threads=2,
        checkpoint_every=1,
        settle_completions=False,
    )
    st = Store.open(settings)
    engine = Engine(settings, model, store=st, name="bench")
    tok = engine.llm.tokenize
    per_turn = max(8, target // turns // 2)  # words per new message (about two tokens each)
    history = tok(b"<start_of_turn>user\n" + prompt_text(1, per_turn).encode(), add_bos=True)
    rows = []
    for turn in range(turns):
        starts = [len(history)]
        history += tok(f"\n{prompt_text(turn + 2, per_turn)}<end_of_turn>\n<start_of_turn>model\n".encode(), add_bos=False)
        engine.forget_context()
        spec = job_spec(
            history,
            model=engine.fingerprint,
            chunk_size=CHUNK,
            sampling=SamplingParams(max_tokens=16, temperature=0.0, top_k=1),
            message_starts=starts if turn else None,
        )
        t0 = time.perf_counter()
        result = engine.run(spec, lambda _: True)
        assert engine.publisher is not None and engine.publisher.wait_idle(600)
        rows.append(
            {
                "turn": turn,
                "prompt_tokens": len(history),
                "restored": result.usage.cached_from_store,
                "seconds": round(time.perf_counter() - t0, 3),
                "store_bytes": st.index.total_bytes(),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        history += result.tokens + tok(b"<end_of_turn>\n<start_of_turn>user\n", add_bos=False)
    blobs = sorted(p.stat().st_size for p in (Path(tmp) / "store").rglob("*") if p.is_file())
    sizes = []
    cursor = 0
    while True:
        cursor, entries = st.index.scan(cursor, 500)
        sizes += [{"index": e.index, "size": e.size} for e in entries]
        if cursor == 0:
            break
    engine.close()
    st.close()
summary = {
    "policy": policy,
    "target": target,
    "turns": turns,
    "final_prompt_tokens": rows[-1]["prompt_tokens"],
    "store_bytes": rows[-1]["store_bytes"],
    "blob_files": len(blobs),
    "blob_file_bytes": sum(blobs),
    "largest_blob": blobs[-1] if blobs else 0,
    "rows": rows,
    "entries": sizes,
}
(out_dir / f"agent-session-{policy}-{target}.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: v for k, v in summary.items() if k not in ("rows", "entries")}))
