"""The bytes a session leaves in the store, replayed from checkpoint sizes measured on Gemma 3 270M (`agent_session.py`).

Each turn resumes from the previous turn's last checkpoint and stores what
`worker.cache.checkpoints.checkpoint_stops` (or, for ``before``, every boundary) picks past it;
``spaced`` also drops the conversation's tails before where it resumed, as
`store.checkpoints.Checkpoints.supersede` does. A checkpoint's size is the measured one,
fitted as a line in its position (the window is full past 512 tokens, and the global
attention layers' cells grow with the position). First the measured 8k sessions are
replayed (their prompt lengths, from the JSON), to check the replay against the store's
real count; then longer sessions are extrapolated.

    python docs/bench/checkpoints-gemma3/session_model.py docs/bench/checkpoints-gemma3/agent-session-*.json
"""

import json
import sys
from pathlib import Path

import numpy as np

from worker.cache.checkpoints import WINDOW_ALIGN, aligned, checkpoint_stops

CHUNK, N_SWA = 256, 512


def every_boundary(start: int, n: int, hints: list[int]) -> list[int]:
    stops = {d * CHUNK for d in range(start // CHUNK + 1, (n - 2) // CHUNK + 1) if aligned(d * CHUNK, N_SWA)}
    for want in [*hints, n - 2]:
        pos = want - (want - N_SWA) % WINDOW_ALIGN if want > N_SWA else want
        if start < pos <= n - 2 and all(abs(pos - s) >= 2 for s in stops | {start}):
            stops.add(pos)
    return sorted(stops)


def replay(lengths: list[int], hints: list[int | None], policy: str, size) -> tuple[int, int, int]:
    """(bytes held at the end, blobs held, bytes written) for a conversation whose turns have these prompt lengths."""
    held: set[int] = set()
    written, start = 0, 0
    for n, hint in zip(lengths, hints):
        hs = [hint] if hint else []
        stops = checkpoint_stops(start, n, CHUNK, 1, N_SWA, hs) if policy == "spaced" else every_boundary(start, n, hs)
        new = [s for s in stops if s not in held]
        written += sum(size(s) for s in new)
        held |= set(new)
        if policy == "spaced" and new and start:
            held -= {p for p in held if p % CHUNK and p < start}
        start = max(stops) if stops else start
    return sum(size(p) for p in held), len(held), written


runs = {Path(p).stem: json.load(open(p)) for p in sys.argv[1:]}
ref = next((r for r in runs.values() if r["policy"] == "before"), next(iter(runs.values())))  # the fit: every boundary
biggest: dict[int, int] = {}
for e in ref["entries"]:
    biggest[e["index"]] = max(biggest.get(e["index"], 0), e["size"])
pos = np.array([(i + 1) * CHUNK for i in biggest if (i + 1) * CHUNK > N_SWA], dtype=float)
sz = np.array([s for i, s in biggest.items() if (i + 1) * CHUNK > N_SWA], dtype=float)
b, a = np.polyfit(pos, sz, 1)
small = biggest.get(0, int(a + b * CHUNK))


def size(p: int) -> int:
    return int(a + b * p) if p > N_SWA else int(small + (a + b * N_SWA - small) * max(0, p - CHUNK) / (N_SWA - CHUNK))


out = {
    "fit": {"bytes_at_0": round(a), "bytes_per_token": round(b, 1), "at_32k_MB": round(size(32768) / 1e6, 1)},
    "checks": {},
    "sessions": [],
}
for name, run in runs.items():
    policy = run["policy"]
    lengths = [r["prompt_tokens"] for r in run["rows"]]
    hints = [None] + [lengths[i - 1] + 16 + 5 for i in range(1, len(lengths))]  # the answer (16 tokens) and the turn markers
    model_bytes, model_blobs, _ = replay(lengths, hints, policy, size)
    out["checks"][name] = {
        "measured_bytes": run["store_bytes"],
        "replayed_bytes": model_bytes,
        "measured_blobs": run["blob_files"],
        "replayed_blobs": model_blobs,
    }
for first, last, turns in [(1000, 30_000, 40), (18_000, 32_768, 40), (18_000, 32_768, 150), (18_000, 32_768, 300)]:
    lengths = [int(x) for x in np.linspace(first, last, turns)]
    hints = [None] + [lengths[i - 1] + 100 for i in range(1, turns)]
    row = {"first_tokens": first, "last_tokens": last, "turns": turns}
    for policy in ("spaced", "before"):
        held, blobs, written = replay(lengths, hints, policy, size)
        row[policy] = {"held_GB": round(held / 1e9, 2), "blobs": blobs, "written_GB": round(written / 1e9, 2)}
    out["sessions"].append(row)
print(json.dumps(out, indent=1))
