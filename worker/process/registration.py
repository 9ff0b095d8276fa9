"""What a worker leaves in Redis when it dies, and how the living recognise and clear it.

* Its RQ registration: `registration_is_stale` says whether it belongs to a process that
  is gone, so that a worker restarted under the same name starts at once (`claim_name`).
* Its private queue: `rescue_orphaned_queues` moves the jobs of a worker whose advert
  expired to the shared queue (every worker's maintenance, and a stopping worker).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import redis
from rq import Queue, worker_registration
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.utils import now, utcparse
from rq.worker import BaseWorker

from worker.advert import adverts
from worker.errors import WorkerNameTaken
from worker.protocol import WORKER_QUEUE_PREFIX

log = logging.getLogger("kvpool.worker")

STALE_S = 30.0
"""A registration whose last heartbeat is older than this belongs to a worker that is gone."""


def registration_is_stale(info: dict[bytes, bytes], hostname: str, stale_s: float) -> bool:
    """Whether an RQ worker registration belongs to a process that is gone."""
    pid = int(info.get(b"pid", b"0") or 0)
    if info.get(b"hostname", b"").decode() == hostname and (pid == os.getpid() or not _pid_alive(pid)):
        return True  # this host's process table is the authority; a pid equal to ours is a restarted container
    beat = info.get(b"last_heartbeat")
    if not beat:
        return True
    return (now() - utcparse(beat.decode())).total_seconds() > stale_s


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def rescue_orphaned_queues(conn: redis.Redis, shared: Queue) -> int:
    """Move jobs from the private queues of workers that are gone (their advert expired) to the shared queue.

    Any worker may do this at its maintenance, so each orphaned queue is emptied under
    RQ's maintenance lock of that queue, and a job is enqueued only by whoever removed it
    from the queue (LREM's count): two workers never enqueue one job twice. A job whose
    record has expired is dropped from the queue, as RQ's dequeue drops it.
    """
    alive = {a.worker for a in adverts(conn)}
    moved = 0
    for q in Queue.all(connection=conn):
        if not q.name.startswith(WORKER_QUEUE_PREFIX) or q.name[len(WORKER_QUEUE_PREFIX) :] in alive:
            continue
        if not q.acquire_maintenance_lock():
            continue
        try:
            StartedJobRegistry(queue=q).cleanup()
            moved += sum(_move(conn, q, job_id, shared) for job_id in q.get_job_ids())
        finally:
            q.release_maintenance_lock()
        if moved:
            log.info("rescue.moved", extra={"from": q.name, "jobs": moved})
    return moved


def _move(conn: redis.Redis, q: Queue, job_id: str, shared: Queue) -> bool:
    """``job_id`` from ``q`` to ``shared``, if this caller is the one that removed it from ``q``."""
    if not q.remove(job_id):
        return False
    try:
        job = Job.fetch(job_id, connection=conn)
    except NoSuchJobError:
        return False
    job.origin = shared.name
    job.save()
    shared.enqueue_job(job)
    return True


def claim_name(worker: BaseWorker) -> None:
    """Clear the registration a dead worker of ``worker``'s name left behind; `WorkerNameTaken` if that worker lives."""
    info = worker.connection.hgetall(worker.key)
    if not info or b"death" in info:
        return
    if not registration_is_stale(info, worker.hostname or "", STALE_S):
        host, pid = info.get(b"hostname", b"?").decode(), info.get(b"pid", b"?").decode()
        raise WorkerNameTaken(f"a live worker named {worker.name!r} is registered (host {host}, pid {pid}); set another KVPOOL_WORKER_NAME")
    with worker.connection.pipeline() as pipe:
        pipe.delete(worker.key)
        worker_registration.unregister(worker, pipe)
        pipe.execute()
    log.warning("worker.stale_registration_cleared", extra={"worker": worker.name, "pid": info.get(b"pid", b"").decode()})
