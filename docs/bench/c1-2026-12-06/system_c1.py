"""One client's decode over HTTP, llama-server 1 slot beside kvpool's default worker, with every process's CPU.

4 requests of 256 greedy tokens (`gateway.pool.bench.peers.decode_run` at concurrency 1),
each system started afresh and warmed up as `kvpool bench-peers` does. Printed per system:
tokens/s, and the CPU seconds each process (and each thread of it, by thread id) used
during the run, so that what is not llama.cpp's computing threads shows.

    python docs/bench/c1-2026-12-06/system_c1.py LLAMA_SERVER MODEL.gguf [ROUNDS] [CLIENTS]

With CLIENTS (default 1) clients, 4 requests each, against llama-server with as many
slots as clients (`server-4` for 4) and the same default worker.
"""

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from gateway.pool.bench.peers import _warm_up, decode_run, systems  # noqa: E402

TCK = os.sysconf("SC_CLK_TCK")


def cpu_by_thread() -> dict[tuple[str, str], tuple[str, float]]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                f = stat[stat.rindex(")") + 2 :].split()
                out[(pid, tid)] = (cmd, (int(f[11]) + int(f[12])) / TCK)
        except OSError:
            pass
    return out


def label(cmd: str) -> str:
    for name in ("llama-server", "kvpool worker", "kvpool gateway", "redis-server"):
        if name in cmd:
            return name
    return cmd.split(" ")[0][-30:]


def main() -> None:
    binary, model = Path(sys.argv[1]), Path(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    clients = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    name = model.name.removesuffix(".gguf")
    with tempfile.TemporaryDirectory() as logs:
        found = systems(binary, model, threads=2, n_ctx=4096, logs=Path(logs), only=(f"server-{clients}", "kvpool"))
        for r in range(rounds):
            for system, start in found.items():
                with start() as urls:
                    _warm_up(urls, name)
                    before, t0 = cpu_by_thread(), time.perf_counter()
                    run = decode_run(system, urls, name, requests=4 * clients, concurrency=clients, max_tokens=256)
                    wall, after = time.perf_counter() - t0, cpu_by_thread()
                used = sorted(((c - before.get(k, ("", 0.0))[1], label(cmd), k[1]) for k, (cmd, c) in after.items()), reverse=True)
                print(f"round {r} {system}: {run.completion_tokens} tokens in {wall:.2f} s, {run.completion_tokens / wall:.1f} tokens/s")
                for cpu, who, tid in used:
                    if cpu >= 0.02:
                        print(f"    {cpu:6.2f} s CPU  {who} (thread {tid})")


if __name__ == "__main__":
    main()
