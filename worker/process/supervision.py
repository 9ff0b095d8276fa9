"""A worker process's threads are supervised: one that dies stops the whole process, which exits non-zero.

The threads that matter are each sequence's RQ worker (the first runs in the main thread,
the others in threads of their own, `worker.process.main`) and the engine loop's, the only one that
touches the context (`worker.engine.loop`). Were one to die and the others go on, the process would look
alive and ready while every job routed to the dead sequence waited forever, or every
decode hung. So a death is never silent:

* it is logged (``worker.thread_died``, with the exception);
* ``on_death`` runs at once: the process stops as on SIGTERM (the jobs in hand finish,
  nothing new is taken) and ``/readyz`` turns false;
* once every thread is done, `Supervisor.check` raises `ThreadDied`, so ``kvpool worker``
  exits 1 and whatever runs it (Kubernetes, docker, systemd) starts it again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("kvpool.worker")


class ThreadDied(RuntimeError):
    """A thread of the worker process died of an exception; the process stopped because of it."""


class Supervisor:
    def __init__(self, on_death: Callable[[str], None]) -> None:
        self.on_death = on_death
        self._lock = threading.Lock()
        self.dead: list[str] = []

    def died(self, name: str, error: BaseException) -> None:
        """Thread ``name`` ended with ``error``: stop the process (once), and remember it for `check`."""
        with self._lock:
            first = not self.dead
            self.dead.append(name)
        try:
            if first:
                self.on_death(name)
        finally:  # logged once the process is unready and stopping: whoever reads the line sees that already
            log.error("worker.thread_died", extra={"died": name, "error": f"{type(error).__name__}: {error}"}, exc_info=error)

    def thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        """A thread running ``target``, whose death by an exception is `died`."""

        def run() -> None:
            try:
                target()
            except BaseException as e:
                self.died(name, e)

        return threading.Thread(target=run, name=name, daemon=True)

    def check(self) -> None:
        """Raise `ThreadDied` if any thread died."""
        if self.dead:
            raise ThreadDied(f"a thread of the worker died ({', '.join(self.dead)}); see worker.thread_died in the log")
