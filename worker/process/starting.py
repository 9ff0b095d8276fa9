"""A worker process says it is starting, while its model loads and its start-up checks run.

A gateway that finds no live worker tells a starting pool (the request waits for a worker,
``KVPOOL_START_WAIT_S``) from one whose workers died (503 at once) by these announcements
(`worker.advert.STARTING_KEY`). Whoever spawns the process announces it first
(`gateway.pool.procs.WorkerProcess`), so there is no gap while Python starts; the process
then announces itself every `REFRESH_S` for `worker.advert.LIVE_S` until its engines are
built. Its first advert removes the announcement (`worker.advert.advertise`, in one
script), so a gateway never sees a worker that is neither starting nor live in between;
a process that dies while loading counts as starting for at most `worker.advert.LIVE_S` more.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from types import TracebackType

import redis

from worker.advert import LIVE_S, announce_starting, withdraw_starting

log = logging.getLogger("kvpool.worker")

REFRESH_S = LIVE_S / 4
"""How often a starting worker announces itself again: three announcements may fail before it stops counting as starting."""


class StartingNotice:
    """``with StartingNotice(redis_url):`` announces this process as starting until the block ends, and withdraws it if the block raises."""

    def __init__(self, redis_url: str) -> None:
        self.conn = redis.Redis.from_url(redis_url, socket_connect_timeout=1, socket_timeout=1)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvpool-starting", daemon=True)

    def _run(self) -> None:
        while True:
            try:
                announce_starting(self.conn, self.host, self.pid)
            except redis.RedisError as e:  # Redis not up yet: the worker waits for it too
                log.debug("worker.starting_not_announced", extra={"reason": str(e)})
            if self.done.wait(REFRESH_S):
                return

    def __enter__(self) -> StartingNotice:
        self.thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.done.set()
        self.thread.join()
        if kind is not None:  # not starting any more; a worker that starts leaves it to its first advert
            self.withdraw()

    def withdraw(self) -> None:
        """This process is not starting any more (it failed, or was stopped while it loaded)."""
        try:
            withdraw_starting(self.conn, self.host, self.pid)
        except redis.RedisError:
            pass  # it stops counting as starting within `LIVE_S`
