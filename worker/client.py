"""The client side of jobs: enqueue a `JobSpec`, read its events, cancel it. Used by the gateway and batch jobs.

The one module of the client side that touches RQ: the gateway asks here for queue
lengths, a job's status and its return value, and never imports ``rq`` itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import redis
import redis.asyncio
from pydantic import TypeAdapter
from rq import Queue, Retry
from rq.job import Job, JobStatus

from worker.protocol import DoneEvent, ErrorEvent, JobSpec, Once, StartEvent, TokenEvent, cancel_key, stream_key

READ_BACKOFF_CAP_S = 0.5
"""The longest wait between two reads of a job's events while Redis is away: the tokens wait for it once Redis is back."""
STRANDED_S = 5.0
"""How long a job must be seen stranded (`requeue_stranded`) before it is put back: a live worker starts a job it popped within milliseconds."""

Event = StartEvent | TokenEvent | DoneEvent | ErrorEvent
_EVENT = TypeAdapter(Event)


def submit(
    conn: redis.Redis,
    spec: JobSpec,
    *,
    queue: str,
    attempts: int = 3,
    timeout_s: int = 600,
    job_id: str | None = None,
    depends_on: Job | str | None = None,
) -> Job:
    """Enqueue ``spec`` for the workers listening on ``queue``; a dead worker's job is tried again up to ``attempts`` times."""
    return Queue(queue, connection=conn).enqueue(
        "worker.process.jobs.run_job",
        spec.model_dump(),
        job_id=job_id,
        job_timeout=timeout_s,
        result_ttl=3600,
        failure_ttl=3600,
        retry=Retry(max=attempts - 1) if attempts > 1 else None,
        depends_on=depends_on,
    )


def final_event(event: Event) -> bool:
    """The job's last event: its answer, or an error that is not retried."""
    return isinstance(event, DoneEvent) or (isinstance(event, ErrorEvent) and not event.retrying)


def parse_event(line: bytes | str) -> Event:
    """One event line of a stream entry. A token, the bulk of every stream, is built without validation: a worker wrote it from one."""
    data = json.loads(line)
    if data.get("type") == "token":
        return TokenEvent.model_construct(**data)
    return _EVENT.validate_python(data)


def entry_events(fields: dict[bytes, bytes]) -> list[Event]:
    """Every event a stream entry holds, in order (`worker.protocol.entry`)."""
    return [parse_event(line) for line in fields[b"e"].split(b"\n")]


def take_events(once: Once, fields: dict[bytes, bytes]) -> list[Event]:
    """The events of a stream entry a reader takes: none it has seen, none of a superseded attempt (`Once`)."""
    out = []
    for line in once.take(fields):
        event = parse_event(line)
        if once.current(fields, isinstance(event, StartEvent)):
            out.append(event)
    return out


def _entries(batch: list[Any], once: Once) -> tuple[bytes, list[Event]]:
    """The last entry id and the events of one XREAD reply for one stream that a reader takes (`take_events`)."""
    entries = batch[0][1]
    return entries[-1][0], [e for _, fields in entries for e in take_events(once, fields)]


def events(conn: redis.Redis, job_id: str, *, timeout_s: float = 600.0, block_ms: int = 1000) -> Iterator[Event]:
    """Yield the job's events from the start, until a final one (done, or an error not retried).

    Raises `TimeoutError` when nothing arrives for ``timeout_s`` seconds.
    """
    key, last, once = stream_key(job_id), b"0", Once()
    deadline = time.monotonic() + timeout_s
    while True:
        batch = conn.xread({key: last}, count=256, block=block_ms)
        if not batch:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no event from job {job_id} for {timeout_s:.0f} s")
            continue
        deadline = time.monotonic() + timeout_s
        last, found = _entries(batch, once)
        for event in found:
            yield event
            if final_event(event):
                return


_REQUEUE_STRANDED = """
local job, seen = KEYS[1], KEYS[2]
local prefix, id, grace, shared = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local origin = redis.call('HGET', job, 'origin')
if redis.call('HGET', job, 'status') ~= 'queued' or not origin or redis.call('LPOS', prefix .. origin, id) then
  redis.call('DEL', seen)
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local first = tonumber(redis.call('GET', seen))
if not first then
  redis.call('SET', seen, tostring(now), 'EX', 3600)
  return 0
end
if now - first < grace then
  return 0
end
redis.call('HSET', job, 'origin', shared)
redis.call('LPUSH', prefix .. shared, id)
redis.call('DEL', seen)
return 1
"""
"""Put a stranded job back at the front of the shared queue, atomically with the checks that find it stranded.

A job is stranded when RQ records it as queued while no queue holds it: a worker that
listens on two queues pops with BLPOP, and RQ records the job as started a few
milliseconds later; a worker killed in between takes the job with it. (RQ's own
guard, its intermediate queue, serves only workers of one queue, and recovers a job
after a minute.) The first call that finds the job stranded notes the time (Redis's
clock, so every gateway agrees); a call at least ``grace`` seconds later moves it.
Any call that finds the job queued, started or ended forgets the note.
"""


def _stranded_args(job_id: str, shared_queue: str, grace_s: float) -> tuple[Any, ...]:
    keys = (job_key(job_id), f"kvpool:stranded:{job_id}")
    return (_REQUEUE_STRANDED, len(keys), *keys, Queue.redis_queue_namespace_prefix, job_id, grace_s, shared_queue)


def requeue_stranded(conn: redis.Redis, job_id: str, shared_queue: str, grace_s: float = STRANDED_S) -> bool:
    """Whether the job was stranded (popped by a worker that died before starting it) and is now back in ``shared_queue``."""
    return bool(conn.eval(*_stranded_args(job_id, shared_queue, grace_s)))


async def arequeue_stranded(conn: redis.asyncio.Redis, job_id: str, shared_queue: str, grace_s: float = STRANDED_S) -> bool:
    """`requeue_stranded` for asyncio."""
    return bool(await conn.eval(*_stranded_args(job_id, shared_queue, grace_s)))


def job_exists(conn: redis.Redis, job_id: str) -> bool:
    return bool(conn.exists(Job.key_for(job_id)))


def cancel(conn: redis.Redis, job_id: str, ttl_s: int = 600) -> None:
    """Ask the worker to stop generating (at its next write to the stream); a job still queued is dropped when it starts."""
    conn.set(cancel_key(job_id), 1, ex=ttl_s)


ENDED = frozenset({JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED})
"""RQ statuses of a job that will not run again."""
RUNNING = frozenset({JobStatus.QUEUED, JobStatus.STARTED, JobStatus.DEFERRED, JobStatus.SCHEDULED})
"""RQ statuses of a job that is still to run or running."""


def queue_key(name: str) -> str:
    """The Redis list of RQ queue ``name`` (its length is the jobs waiting in it)."""
    return Queue.redis_queue_namespace_prefix + name


def job_key(job_id: str) -> str:
    """The Redis hash of RQ job ``job_id`` (its ``status`` field is the job's `JobStatus`)."""
    return str(Job.key_for(job_id))


def job_status(raw: bytes | str | None) -> JobStatus | None:
    """A job's ``status`` field as read from `job_key`, or None when the job is gone."""
    if raw is None:
        return None
    return JobStatus(raw.decode() if isinstance(raw, bytes) else raw)


def return_value(conn: redis.Redis, job_id: str) -> Any:
    """What the job function returned, or None (job gone, or no result)."""
    job = Job.fetch_many([job_id], connection=conn)[0]
    return job.return_value() if job is not None else None


def delete_job(conn: redis.Redis, job_id: str) -> None:
    """Remove a job that has not run (a batch's waiting dependent whose leader failed)."""
    job = Job.fetch_many([job_id], connection=conn)[0]
    if job is not None:
        job.delete()
