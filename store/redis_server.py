"""A redis-server process managed by kvpool (for `kvpool up` and the tests), and helpers for the processes kvpool starts."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def stop_process(proc: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; returns the exit status."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """Starts ``redis-server`` on a free loopback port with its data in ``data_dir``."""

    def __init__(self, data_dir: Path, *, port: int | None = None, persist: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (the README's set-up command installs it)")
        self.binary = binary
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.persist = persist
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        args += ["--appendonly", "yes"] if self.persist else ["--save", "", "--appendonly", "no"]
        # Its own session: a Ctrl-C in the terminal reaches only the supervisor, which stops Redis last.
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
