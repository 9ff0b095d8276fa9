"""Steps of sequences apart, with and without fillers, through the engine loop itself (`worker.engine.loop.EngineLoop`).

Four sequences of one context hold a 300-token prompt each; the sequences of each set
decode 24 one-token steps at once, one thread each (as a worker's jobs do). Printed: wall
seconds per set with the loop's fillers off and on (its start-up measure), interleaved,
and whether every step's logits were the same bits both ways.

    python docs/bench/rounds-2026-12-06/fillers.py MODEL.gguf [ROUNDS]
"""

import sys
import threading
import time

import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from worker.engine.context import Context  # noqa: E402
from worker.settings import WorkerSettings  # noqa: E402

STEPS, PROMPT = 24, 300
SETS = ([0, 1], [0, 2], [0, 3], [0, 1, 3], [0, 1, 2, 3])


def run(loop, seqs, base):
    logits = {s: [] for s in seqs}

    def one(s):
        tok = 100 + s
        for j in range(STEPS):
            out = loop.decode(s, [tok], base + j)
            tok = int(np.argmax(out))
            logits[s].append(out.copy())

    threads = [threading.Thread(target=one, args=(s,)) for s in seqs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, logits


def main():
    model, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    ctx = Context(WorkerSettings(n_threads=2, parallel=4, n_ctx=1024), model)
    loop = ctx.loop
    cost = loop.measure_steps(4, 1)
    print("start-up measure, ms by consecutive sequences 1..4:", [round(c * 1000, 1) for c in cost])
    rng = np.random.default_rng(0)
    for s in range(4):
        loop.decode(s, rng.integers(100, 20000, PROMPT).tolist(), 0)
    for seqs in SETS:
        times = {"off": [], "on": []}
        same = True
        for _ in range(rounds):
            ref = None
            for mode in ("off", "on"):
                loop.step_cost = cost if mode == "on" else None
                dt, logits = run(loop, seqs, PROMPT)
                times[mode].append(dt)
                ref = ref or logits
                same = same and all(np.array_equal(a, b) for s in seqs for a, b in zip(ref[s], logits[s], strict=True))
        med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
        print(
            f"sequences {seqs}: fillers off {med['off']:.2f} s, on {med['on']:.2f} s ({med['off'] / med['on']:.2f}x); logits identical: {same}"
        )
    print("filler tokens decoded:", loop.filled)
    ctx.close()


main()
