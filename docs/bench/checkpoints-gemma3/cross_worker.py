"""Gemma 3 270M: same-worker vs cross-worker TTFT for a second question on a shared 1,410-token system prompt (W1's shape)."""

import json
import statistics
import sys
import time
from pathlib import Path

import redis

from gateway.pool.procs import RedisServer, WorkerProcess
from gateway.pool.s3server import S3Server
from tests.helpers import PoolClient, env_for_pool, prompt_text, s3_settings

model, logs = Path(sys.argv[1]), Path(sys.argv[2])
logs.mkdir(parents=True, exist_ok=True)
s3 = S3Server(log_path=logs / "s3.log").start()
out = {"same": [], "cross": []}
with RedisServer(logs / "redis") as rs:
    env = {
        **env_for_pool(rs.url, s3_settings(s3.endpoint_url, "kvpool-bench", rs.url), model, 32),
        "KVPOOL_N_CTX": "4096",
        "KVPOOL_CHECKPOINT_EVERY": "8",
    }
    client = PoolClient(redis.Redis.from_url(rs.url), model, n_ctx=4096)
    system = client.tokens("<start_of_turn>user\n" + prompt_text(31, 1400))

    def ask(q: int, worker: str):
        toks = system + client.tokens(f"\nQuestion {q}: what does part {q} say?<end_of_turn>\n<start_of_turn>model\n")
        spec = client.spec(toks, max_tokens=4).model_copy(update={"message_starts": [len(system)]})
        o = client.collect(client.submit(spec, worker=worker))
        return o.result

    for i in range(3):
        w1 = WorkerProcess(f"a{i}", env, logs / f"a{i}.log").start()
        r0 = ask(100 + i, f"a{i}")  # cold: publishes the checkpoint at the message start
        time.sleep(2)  # let the publish land (measurement script, not a test)
        same = ask(200 + i, f"a{i}")
        w2 = WorkerProcess(f"b{i}", env, logs / f"b{i}.log").start()
        cross = ask(300 + i, f"b{i}")
        out["same"].append((same.timings.first_token_s, same.usage.cached_tokens))
        out["cross"].append((cross.timings.first_token_s, cross.usage.cached_tokens))
        w1.kill()
        w2.kill()
        redis.Redis.from_url(rs.url).flushall()
s3.stop()
out["same_p50"] = statistics.median(t for t, _ in out["same"])
out["cross_p50"] = statistics.median(t for t, _ in out["cross"])
out["ratio"] = out["cross_p50"] / out["same_p50"]
print(json.dumps(out, indent=1))
