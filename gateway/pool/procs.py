"""Every process kvpool starts: redis-server, a local S3 server, ``kvpool worker``, ``kvpool gateway`` and ``llama-server``.

``kvpool up``, the benchmarks and the tests all start processes through this module, and
only through it. Each process runs in its own session, so a Ctrl-C in a terminal reaches
only the supervisor, which then stops what it started. One loop, `wait_ready`, waits for
any of them until its readiness probe answers, and fails with the process's log when it
exits first or the time runs out; `stop_process` stops any of them (SIGTERM, then SIGKILL).

The library packages never import this module: starting processes is the edge's job.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

import httpx
import redis

from worker.advert import Advert, adverts, announce_starting
from worker.protocol import slot_names

S3_ACCESS_KEY = "kvpool-local"
S3_SECRET_KEY = "kvpool-local-secret"
"""Credentials of the local S3 server (`S3Server` is started with these as its one identity)."""


SPAWNED_S = 60.0
"""How long a spawned worker counts as starting before it announces itself (`worker.process.starting`): Python and llama.cpp load first."""

LISTEN_PORTS = (20000, 32768)
"""Where `free_port` looks: below Linux's default ephemeral range (32768-60999), which outgoing connections draw from."""

_handed_out: set[int] = set()

ready_hooks: list[Callable[[Process, float], None]] = []
"""Called with each process and the seconds it took from spawn to ready (the test suite records them)."""


def free_port() -> int:
    """A local port nothing listens on now, for a process about to listen on it.

    A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, from which
    every outgoing connection (a worker's Redis and S3 clients) also takes its local port:
    one could take it between this check and the listener's bind ("address already in
    use"). So the port is drawn from below that range, and never twice in one process.
    """
    low, high = _listen_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every draw was taken: any free port
        s.bind(("127.0.0.1", 0))
        found: int = s.getsockname()[1]
        return found


def _listen_range() -> tuple[int, int]:
    """`LISTEN_PORTS`, ending where the kernel's ephemeral range starts if that is lower."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = LISTEN_PORTS[1]
    low, high = LISTEN_PORTS[0], min(LISTEN_PORTS[1], ephemeral_low)
    return (low, high) if high - low >= 1000 else (1024, 65536)


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


def wait_ready(ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, timeout_s: float, log: str | None = None) -> None:
    """Poll ``ready`` until it is true; raise if ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited with status {proc.returncode}" if proc.returncode is not None else f"not ready after {timeout_s:g} s"
            raise RuntimeError(f"{what} did not start ({why})" + (f"; its log {log}:\n{_tail(log)}" if log else ""))
        time.sleep(0.05)


def http_ok(url: str) -> Callable[[], bool]:
    """A readiness probe: ``url`` answers 200."""

    def probe() -> bool:
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    return probe


def _tail(path: str, limit: int = 3000) -> str:
    try:
        return Path(path).read_bytes()[-limit:].decode(errors="replace")
    except OSError as e:
        return f"(unreadable: {e})"


def child_env(env: dict[str, str] | None = None, *, inherit_settings: bool = True) -> dict[str, str]:
    """This process's environment plus ``env``; without its ``KVPOOL_*`` variables unless ``inherit_settings``."""
    base = {k: v for k, v in os.environ.items() if inherit_settings or not k.startswith("KVPOOL_")}
    return {**base, **(env or {})}


class Process(ABC):
    """A child process with its output in a log file; subclasses say how to start it and when it is ready."""

    what = "process"
    cwd: os.PathLike[str] | str | None = None
    """Where it runs (None: here)."""

    def __init__(self, log_path: os.PathLike[str] | str, env: dict[str, str] | None = None, *, inherit_settings: bool = True) -> None:
        self.log_path = log_path
        self.env = child_env(env, inherit_settings=inherit_settings)
        self.proc: subprocess.Popen[bytes] | None = None
        self.spawned_at = 0.0

    @abstractmethod
    def args(self) -> list[str]: ...

    @abstractmethod
    def ready(self) -> bool: ...

    def spawn(self) -> Self:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args(), env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.cwd
            )
        self.spawned_at = time.monotonic()
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> Self:
        assert self.proc is not None, "spawn() first"
        try:
            wait_ready(self.ready, self.proc, self.what, timeout_s, str(self.log_path))
        except RuntimeError:
            self.stop()
            raise
        for hook in ready_hooks:
            hook(self, time.monotonic() - self.spawned_at)
        return self

    def start(self, timeout_s: float = 120.0) -> Self:
        return self.spawn().wait_ready(timeout_s)

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> int | None:
        return stop_process(self.proc, timeout_s)


def kvpool_command(*args: str) -> list[str]:
    """The ``kvpool`` command of this Python environment."""
    return [os.path.join(os.path.dirname(sys.executable), "kvpool"), *args]


class WorkerProcess(Process):
    """A ``kvpool worker``, ready once *this* process advertises itself (model loaded, self-check passed, registered)."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        log_path: os.PathLike[str] | str,
        redis_url: str | None = None,
        *,
        inherit_settings: bool = True,
    ) -> None:
        super().__init__(log_path, {**env, "KVPOOL_WORKER_NAME": name}, inherit_settings=inherit_settings)
        self.name = name
        self.what = f"worker {name}"
        self.conn = redis.Redis.from_url(redis_url or self.env.get("KVPOOL_REDIS_URL", "redis://localhost:6379/0"))

    def args(self) -> list[str]:
        return kvpool_command("worker")

    def spawn(self) -> Self:
        """Start it, and announce it as starting at once: a gateway then waits for it instead of answering 503 while Python starts."""
        super().spawn()
        assert self.proc is not None
        try:
            announce_starting(self.conn, socket.gethostname(), self.proc.pid, SPAWNED_S)
        except redis.RedisError:
            pass  # Redis not up yet: the worker announces itself once it reaches it
        return self

    @property
    def names(self) -> list[str]:
        """The RQ workers of its sequences (`KVPOOL_PARALLEL`): its name, or ``name.0``, ``name.1``, ...

        With ``KVPOOL_PARALLEL`` unset or 0 the worker chooses for its model, and its adverts
        say how many it chose; until one does, its name alone.
        """
        try:
            return self._names([] if self._parallel else self._adverts())
        except redis.ConnectionError:
            return self._names([])

    def ready(self) -> bool:
        """Every sequence advertised; an advert left by an earlier process of the same name does not count."""
        try:
            mine = self._adverts()  # one read of the adverts: the names too come from it
        except redis.ConnectionError:
            return False
        return {a.worker for a in mine} >= set(self._names(mine))

    def _names(self, mine: list[Advert]) -> list[str]:
        """Its sequences' names, given its adverts (read only when ``KVPOOL_PARALLEL`` leaves the count to the worker)."""
        return slot_names(self.name, self._parallel or max((a.sequences for a in mine), default=1))

    @property
    def _parallel(self) -> int:
        """``KVPOOL_PARALLEL`` as given to the worker; 0: the worker chooses."""
        return int(self.env.get("KVPOOL_PARALLEL") or 0)

    def _adverts(self) -> list[Advert]:
        """This process's adverts (none before it is spawned)."""
        return [a for a in adverts(self.conn) if a.pid == self.proc.pid] if self.proc is not None else []

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Warm shutdown: the current job finishes first."""
        return stop_process(self.proc, timeout_s)


class GatewayProcess(Process):
    """A ``kvpool gateway``, ready once ``/healthz`` answers."""

    what = "the gateway"

    def __init__(self, env: dict[str, str], port: int, log_path: os.PathLike[str] | str, *, inherit_settings: bool = True) -> None:
        super().__init__(log_path, {**env, "KVPOOL_PORT": str(port)}, inherit_settings=inherit_settings)
        self.port = port

    @property
    def url(self) -> str:
        host = self.env.get("KVPOOL_HOST", "127.0.0.1")
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"

    def args(self) -> list[str]:
        return kvpool_command("gateway")

    def ready(self) -> bool:
        return http_ok(self.url + "/healthz")()


class LlamaServer(Process):
    """llama.cpp's ``llama-server``, ready once ``/health`` answers 200 (the model is loaded)."""

    what = "llama-server"

    def __init__(self, binary: Path, args: list[str], log_path: os.PathLike[str] | str) -> None:
        # A shared-library build keeps its libraries beside the binary.
        super().__init__(log_path, {"LD_LIBRARY_PATH": str(binary.parent)})
        self.binary = binary
        self.port = free_port()
        self.extra = args

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        return [str(self.binary), *self.extra, "--host", "127.0.0.1", "--port", str(self.port)]

    def ready(self) -> bool:
        return http_ok(self.url + "/health")()


class RedisServer(Process):
    """``redis-server`` on a free loopback port with its data in ``data_dir``."""

    what = "redis-server"

    def __init__(self, data_dir: Path, *, port: int | None = None, persist: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (the README's set-up command installs it)")
        self.binary = binary
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.persist = persist
        super().__init__(self.data_dir / "redis-server.log")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        return args + (["--appendonly", "yes"] if self.persist else ["--save", "", "--appendonly", "no"])

    def ready(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.5).ping())
        except redis.ConnectionError:
            return False

    def start(self, timeout_s: float = 10.0) -> Self:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        super().start(timeout_s)
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_together(processes: Iterable[Process], timeout_s: float = 120.0) -> None:
    """Spawn every one of ``processes``, then wait for each: their start-ups (imports, model loads) overlap instead of adding up.

    If one fails to start, every one of them is stopped before the error is raised.
    """
    spawned = [p.spawn() for p in processes]
    try:
        for p in spawned:
            p.wait_ready(timeout_s)
    except BaseException:
        for p in spawned:
            p.stop()
        raise


@contextmanager
def busy_neighbour() -> Iterator[int]:
    """A busy loop pinned to the last CPU this process may use, as another tenant of a shared node; yields that CPU.

    It runs in a session of its own, as the systems do, so the scheduler weighs it as one
    more process among them (with autogroups, one more group).
    """
    cpu = max(os.sched_getaffinity(0))
    loop = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"], start_new_session=True
    )
    try:
        yield cpu
    finally:
        loop.kill()
        loop.wait()
