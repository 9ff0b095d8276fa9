"""Gemma 3 270M's W1 at one client on llama-server as it starts, with a full-size sliding-window cache, and with flash attention off too.

kvpool keeps Gemma's sliding-window layers' cells for the whole context (llama.cpp's full-size
SWA cache), which its whole-state checkpoints need, and turns flash attention off for a
sliding-window model (`worker.engine.context.flash_attn_for`). This runs `kvpool bench-peers`' W1 (a
shared 1,100-word system prompt, 12 questions, the template's end of turn as stop) against
llama-server 1 slot started three ways in turn, each afresh and warmed up, so what each of
those choices costs a token is measured on llama-server itself.

    python docs/bench/stream-entries-2026-12-07/gemma_swa_full.py [rounds]
"""

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from gateway.pool.bench.peer_workloads import workloads  # noqa: E402
from gateway.pool.bench.peers import _warm_up, run_workload, template_stops  # noqa: E402
from gateway.pool.procs import LlamaServer  # noqa: E402

MODEL = ROOT / ".kvpool/models/gemma-3-270m-q4_k_m.gguf"
BINARY = ROOT / ".kvpool/llama-server/bin/llama-server"


def main(rounds: int) -> None:
    name = MODEL.name.removesuffix(".gguf")
    w1 = workloads(ROOT, name, ("W1",), stop=template_stops(MODEL))[0]
    args = ["-m", str(MODEL), "-t", "2", "-tb", "2", "-c", "4096", "-np", "1"]
    with tempfile.TemporaryDirectory() as logs:
        for r in range(rounds):
            for extra in ([], ["--swa-full"], ["--swa-full", "--flash-attn", "off"]):
                server = LlamaServer(BINARY, args + extra, Path(logs) / f"server-{r}-{len(extra)}.log")
                server.spawn()
                try:
                    server.wait_ready()
                    _warm_up([server.url], name)
                    run = run_workload("llama-server", [server.url], w1, 1)
                finally:
                    server.stop()
                label = " ".join(extra) or "default"
                print(
                    f"round {r} {label}: W1 c=1 {run.wall_s:6.2f} s, {run.completion_tokens} tokens, "
                    f"first request's TTFT {run.ttft_s[0]:.2f} s, TTFT p50 {run.ttft_p50 * 1000:.0f} ms",
                    flush=True,
                )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
