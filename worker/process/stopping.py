"""How a worker's RQ loops stop: a flag, checked before each pop and before a popped job starts.

A stop (SIGTERM, SIGINT; `worker.process.main.KvpoolWorker.request_stop`) sets the stop flag of
every RQ worker of the process (one per sequence) and wakes those waiting for a job. It
raises nothing from the signal handler: RQ's own handler raised `StopRequested` wherever
the main thread happened to be, which could be just after its BLPOP had popped a job and
before the job was recorded as started, leaving the job in no queue and no registry.

* **Before a pop** (`StopAwareQueue.dequeue_any`, which RQ calls for every wait for a
  job): a stopping worker pops nothing, and RQ's loop ends through its teardown.
* **A job popped as the stop came** (`push_back`): put back at the front of the queue it
  came from, untouched, for another worker; the stopping one does not start it.
* **A wait for a job** (a BLPOP of up to ``dequeue_timeout`` seconds) is woken at once
  (`wake`, Redis's ``CLIENT UNBLOCK``, as if it had timed out): RQ's loop then comes
  back to the pop, and so to the flag. Every connection of a worker carries its name
  (``client_name``), which is how its waits are found.
* **Redis away**: nothing can be popped or handed back, and RQ's loop sleeps between
  tries to reach it; an idle worker stops there at once (`StopRequested`, from the
  signal handler in the main thread, from the failed heartbeat in the others).
* **RQ's pubsub thread** waits up to its ``sleep_time`` for a message, and RQ's teardown
  joins it (redis-py 8's ``PubSubWorkerThread.stop`` waits for the thread): with RQ's
  60 s that wait was the minute a stopping worker sometimes hung for. `PUBSUB_WAIT_S`
  bounds it.

A job already running finishes first (RQ's warm shutdown), as before.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import redis
from rq import Queue
from rq.exceptions import StopRequested
from rq.job import Job

from worker.process import jobstream

log = logging.getLogger("kvpool.worker")

PUBSUB_WAIT_S = 1.0
"""The longest RQ's pubsub thread waits for a message before it looks at its stop flag again."""

BLOCKING_COMMANDS = frozenset({"blpop", "blmove"})
"""What RQ waits for a job with (several queues: BLPOP; one queue: BLMOVE)."""


def client_name(worker_name: str) -> str:
    """The Redis client name of a worker's connections: its name, with nothing Redis refuses in a client name."""
    return re.sub(r"[^!-~]", "_", worker_name)


class StopAwareQueue(Queue):
    """RQ's queue, which pops nothing once the process is stopping (`jobstream.STOPPING`)."""

    @classmethod
    def dequeue_any(cls, queues: Iterable[Queue], timeout: int | None, connection: redis.Redis, **kwargs: Any) -> tuple[Job, Queue] | None:  # type: ignore[override]
        if jobstream.STOPPING.is_set():
            raise StopRequested()
        return super().dequeue_any(queues, timeout, connection, **kwargs)


def push_back(job: Job, queue: Queue) -> None:
    """A job popped as the stop came, never started: back at the front of its queue, for another worker."""
    queue.push_job_id(job.id, at_front=True)
    log.info("job.pushed_back", extra={"job": job.id, "queue": queue.name})


def wake(conn: redis.Redis, worker_names: Iterable[str]) -> int:
    """End the waits for a job of these workers now (as if they had timed out); how many were woken.

    A connection whose last command was a wait but that waits no more is not blocked,
    and ``CLIENT UNBLOCK`` leaves it alone. Raises `redis.RedisError` when Redis cannot
    be reached: then no worker waits on it for a job, and RQ's loop sleeps between tries.
    """
    names = {client_name(n) for n in worker_names}
    woken = 0
    for c in conn.client_list(_type="normal"):
        if c.get("name") in names and c.get("cmd") in BLOCKING_COMMANDS:
            woken += int(conn.client_unblock(int(c["id"])))
    return woken
