"""Gemma 3 270M: a 2,000-token prompt resent to a fresh worker, cold vs restored from a checkpoint; checkpoint sizes."""

import json
import sys
import time
from pathlib import Path

import redis

from gateway.pool.procs import RedisServer, WorkerProcess
from gateway.pool.s3server import S3Server
from store.checkpoints import checkpoint_key
from store.index import RedisIndex
from tests.helpers import PoolClient, env_for_pool, prompt_text, s3_settings
from worker.cache.checkpoints import checkpoint_stops
from worker.cache.namespace import namespace_for

CHUNK = 32
EVERY = 8
model, logs = Path(sys.argv[1]), Path(sys.argv[2])
logs.mkdir(parents=True, exist_ok=True)
out = {}
s3 = S3Server(log_path=logs / "s3.log").start()
with RedisServer(logs / "redis") as rs:
    settings = s3_settings(s3.endpoint_url, "kvpool-bench", rs.url)
    env = {**env_for_pool(rs.url, settings, model, CHUNK), "KVPOOL_N_CTX": "4096", "KVPOOL_CHECKPOINT_EVERY": str(EVERY)}
    w1 = WorkerProcess("w1", env, logs / "w1.log").start()
    client = PoolClient(redis.Redis.from_url(rs.url), model, n_ctx=4096)
    prompt = client.tokens("<start_of_turn>user\n" + prompt_text(21, 1960) + "\nSum it up.<end_of_turn>\n<start_of_turn>model\n")
    out["prompt_tokens"] = len(prompt)
    cold = client.run(prompt, worker="w1", max_tokens=8)
    out["cold"] = {"first_token_s": cold.timings.first_token_s, "cached": cold.usage.cached_tokens}
    stops = checkpoint_stops(0, len(prompt), CHUNK, EVERY, 512)
    ns = namespace_for(client.settings, client.fingerprint, checkpoints=True)
    keys = ns.chain(prompt)
    wanted = [checkpoint_key(ns, prompt, keys, e) for e in stops]
    index = RedisIndex(client.conn)
    deadline = time.monotonic() + 120
    while not all(index.present(wanted)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    sizes = {e: index.get(k).size for e, k in zip(stops, wanted)}
    out["checkpoint_bytes"] = sizes
    out["stored_bytes_total"] = sum(sizes.values())
    w2 = WorkerProcess("w2", env, logs / "w2.log").start()
    warm = client.run(prompt, worker="w2", max_tokens=8)
    out["restored"] = {
        "first_token_s": warm.timings.first_token_s,
        "cached": warm.usage.cached_tokens,
        "fetch_s": warm.timings.fetch_s,
        "restore_s": warm.timings.restore_s,
    }
    out["same_tokens"] = warm.tokens == cold.tokens
    out["speedup"] = cold.timings.first_token_s / warm.timings.first_token_s
    w1.kill()
    w2.kill()
s3.stop()
print(json.dumps(out, indent=1))
