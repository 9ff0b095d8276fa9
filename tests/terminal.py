"""A program run in a real pseudo-terminal, as a person runs it: read its screen, press Ctrl-C."""

from __future__ import annotations

import os
import pty
import select
import signal
import time
from collections.abc import Sequence


class Terminal:
    """``argv`` as the session leader of a new pty; Ctrl-C goes through the terminal's line discipline."""

    def __init__(self, argv: Sequence[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: exec, never return into pytest
            try:
                os.execvpe(argv[0], list(argv), env)
            finally:
                os._exit(127)
        self.screen = ""
        self.status: int | None = None

    def _read(self, wait_s: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], wait_s)
        if ready:
            try:
                self.screen += os.read(self.fd, 65536).decode(errors="replace")
            except OSError:  # the other side closed
                time.sleep(wait_s)

    def wait_for(self, needle: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while needle not in self.screen:
            assert self.poll() is None, f"exited ({self.status}) before {needle!r}:\n{self.screen}"
            assert time.monotonic() < deadline, f"no {needle!r} within {timeout_s} s:\n{self.screen}"
            self._read(0.1)

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")

    def poll(self) -> int | None:
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status

    def wait(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.poll() is None:
            assert time.monotonic() < deadline, f"still running after {timeout_s} s:\n{self.screen}"
            self._read(0.1)
        self._read(0)
        return self.status  # type: ignore[return-value]

    def close(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.wait(10)
        os.close(self.fd)
