"""Starting ``kvpool worker`` processes: for ``kvpool up``, the benchmarks and the tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import redis

from store.redis_server import stop_process
from worker.advert import Advert, adverts


class WorkerProcess:
    """A real ``kvpool worker`` process with its settings in KVPOOL_* variables."""

    def __init__(self, name: str, env: dict[str, str], log_path: os.PathLike[str] | str) -> None:
        self.name = name
        self.env = {**os.environ, **env, "KVPOOL_WORKER_NAME": name}
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, conn: redis.Redis, timeout_s: float = 120.0) -> WorkerProcess:
        """Start the process and wait until *it* advertises itself (model loaded, self-check done, registered)."""
        return self.spawn().wait_ready(conn, timeout_s)

    def spawn(self) -> WorkerProcess:
        log = open(self.log_path, "ab")  # handed to the child process
        kvpool = os.path.join(os.path.dirname(sys.executable), "kvpool")
        self.proc = subprocess.Popen([kvpool, "worker"], env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, conn: redis.Redis, timeout_s: float = 120.0) -> WorkerProcess:
        """Wait until this process advertises itself; an advert left by an earlier process of the name does not count."""
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + timeout_s
        while not any(a.worker == self.name and a.pid == self.proc.pid for a in _adverts(conn)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.name} did not start; log: {self.log_path}\n{self.log()[-3000:]}")
            time.sleep(0.1)
        return self

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Warm shutdown: the current job finishes first."""
        return stop_process(self.proc, timeout_s)


def _adverts(conn: redis.Redis) -> list[Advert]:
    try:
        return adverts(conn)
    except redis.ConnectionError:
        return []
