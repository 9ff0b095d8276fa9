"""The processes a bench run owns: redis-server, an S3 server (SeaweedFS) or a store folder, and kvpool workers.

Everything is started on free loopback ports under one scratch folder and stopped by
`Services.close`, which the runner calls from ``finally`` (so also on Ctrl-C and on
errors). The scratch folder (logs, Redis data, the filesystem store, the disk cache)
is deleted at the end of a run that succeeded and kept, with its path printed, after
one that failed.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis import Redis

from gateway.pool.procs import S3_ACCESS_KEY, S3_SECRET_KEY, RedisServer, WorkerProcess, free_port
from gateway.pool.s3server import S3Server
from store.settings import StoreSettings

BUCKET = "kvpool-bench"


@dataclass
class WorkerSpec:
    name: str
    threads: int
    queue: str
    store: bool = True


@dataclass
class Services:
    """Redis, the store and the workers of one run; `store_kind` is ``s3`` or ``fs``."""

    work_dir: Path
    store_kind: str = "s3"
    s3_endpoint_url: str | None = None
    redis: RedisServer | None = None
    s3: S3Server | None = None
    workers: list[WorkerProcess] = field(default_factory=list)
    store_env: dict[str, str] = field(default_factory=dict)

    def start(self) -> Services:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        (self.work_dir / "logs").mkdir(exist_ok=True)
        self.redis = RedisServer(self.work_dir / "redis").start()
        common = {"KVPOOL_REDIS_URL": self.redis.url, "KVPOOL_STATE_DIR": str(self.work_dir / "state")}
        if self.store_kind == "fs":
            self.store_env = {**common, "KVPOOL_STORE_URL": str(self.work_dir / "store")}
        elif self.store_kind == "s3":
            run = f"run-{os.getpid()}-{int(time.time())}"
            if self.s3_endpoint_url:
                endpoint, creds = self.s3_endpoint_url, {}
            else:
                self.s3 = S3Server().start()
                endpoint = self.s3.endpoint_url
                creds = {"KVPOOL_S3_ACCESS_KEY_ID": S3_ACCESS_KEY, "KVPOOL_S3_SECRET_ACCESS_KEY": S3_SECRET_KEY}
            self.store_env = {**common, "KVPOOL_STORE_URL": f"s3://{BUCKET}/{run}", "KVPOOL_S3_ENDPOINT_URL": endpoint, **creds}
        else:
            raise ValueError(f"store must be 's3' or 'fs', not {self.store_kind!r}")
        return self

    @property
    def conn(self) -> Redis[bytes]:
        assert self.redis is not None
        return Redis.from_url(self.redis.url)

    def store_settings(self) -> StoreSettings:
        """The store settings the workers get, for probes run from this process."""
        env: dict[str, Any] = {k.removeprefix("KVPOOL_").lower(): v for k, v in self.store_env.items()}
        return StoreSettings(**env)

    def describe_store(self) -> str:
        if self.store_kind == "fs":
            return "local directory"
        return f"S3 at {self.store_env['KVPOOL_S3_ENDPOINT_URL']}" + ("" if self.s3_endpoint_url else " (SeaweedFS server, loopback)")

    def start_workers(
        self, specs: list[WorkerSpec], *, model: Path, chunk_size: int, n_ctx: int, timeout_s: float = 600.0
    ) -> list[WorkerProcess]:
        """Start the workers side by side and wait until each advertises itself (model loaded, self-check passed)."""
        dead_s3 = f"http://127.0.0.1:{free_port()}"
        procs = []
        for spec in specs:
            env = {
                **self.store_env,
                "KVPOOL_MODEL": str(model),
                "KVPOOL_CHUNK_SIZE": str(chunk_size),
                "KVPOOL_N_CTX": str(n_ctx),
                "KVPOOL_N_THREADS": str(spec.threads),
                "KVPOOL_QUEUE": spec.queue,
                "KVPOOL_LOG_LEVEL": "WARNING",
            }
            if not spec.store:
                # Nothing listens there, so the worker starts with its store disabled (no lookups, no publishing).
                env.update(
                    {
                        "KVPOOL_STORE_URL": f"s3://{BUCKET}/disabled",
                        "KVPOOL_S3_ENDPOINT_URL": dead_s3,
                        "KVPOOL_CONNECT_TIMEOUT_S": "0.5",
                        "KVPOOL_RETRIES": "0",
                    }
                )
            procs.append(WorkerProcess(spec.name, env, self.work_dir / "logs" / f"{spec.name}.log"))
        self.workers += procs
        with ThreadPoolExecutor(len(procs)) as pool:
            for fut in [pool.submit(p.start, timeout_s) for p in procs]:
                fut.result()
        return procs

    def stop_workers(self, procs: list[WorkerProcess] | None = None) -> None:
        """Stop ``procs`` (default: every worker), side by side."""
        procs = list(self.workers if procs is None else procs)
        for w in procs:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.terminate()
        for w in procs:
            w.stop(timeout_s=15)
            if w in self.workers:
                self.workers.remove(w)

    def close(self, *, keep: bool = False) -> None:
        try:
            self.stop_workers()
        finally:
            if self.s3 is not None:
                self.s3.stop()
            if self.redis is not None:
                self.redis.stop()
            if not keep:
                shutil.rmtree(self.work_dir, ignore_errors=True)
