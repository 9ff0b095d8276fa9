"""A local S3-compatible endpoint (moto's server mode) over real HTTP, for the tests and ``kvpool bench``.

It is reached through boto3 with an endpoint URL, exactly as MinIO is in deployment.
Needs ``moto[server]`` (a test extra).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
import urllib.request

from store.redis_server import free_port, stop_process


class S3Server:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> S3Server:
        if importlib.util.find_spec("moto") is None:
            raise RuntimeError("a local S3 endpoint needs moto[server] (pip install 'moto[server]')")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(self.endpoint_url + "/moto-api/", timeout=1).read()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the S3 endpoint (moto) did not start on port {self.port}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None
