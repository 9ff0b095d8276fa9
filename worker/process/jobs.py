"""The RQ job function.

The gateway enqueues ``worker.process.jobs.run_job`` with a `JobSpec` as a dict. It runs inside
a kvpool worker process, which loaded the model once at start-up and registered its
engine here with `bind` (one per sequence, in the thread that runs its RQ worker). Its
events go to the job's Redis stream (`worker.process.jobstream`).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING

import redis
from pydantic import ValidationError
from rq import Queue, get_current_job
from rq.job import Job

from worker import metrics
from worker.advert import adverts
from worker.errors import JobAborted, JobRejected
from worker.process.jobstream import JobStream
from worker.protocol import DoneEvent, ErrorEvent, JobSpec, StartEvent, cancel_key, worker_queue

if TYPE_CHECKING:
    from worker.answering import Engine

log = logging.getLogger("kvpool.worker.jobs")

_bound = threading.local()
"""The engine of the RQ worker running in this thread (one per sequence, `worker.engine.context`)."""


def bind(engine: Engine | None) -> None:
    """Jobs run in this thread from now on answer with ``engine``."""
    _bound.engine = engine


def run_job(spec: dict) -> dict:
    """Answer one completion job; returns the `JobResult` as a dict (also sent as the stream's last event)."""
    job = get_current_job()
    engine: Engine | None = getattr(_bound, "engine", None)
    if job is None or engine is None:
        raise RuntimeError("run_job runs only inside a kvpool worker (kvpool worker)")
    stream = JobStream(job.connection, job.id, engine.settings.stream_ttl_s, engine.settings.stream_interval_ms / 1000)
    attempt = engine.settings.job_attempts - (job.retries_left or 0)
    stream.send(StartEvent(attempt=attempt, worker=engine.name))
    try:
        return _answer(job, engine, spec, stream)
    finally:
        stream.close()


def _answer(job: Job, engine: Engine, spec: dict, stream: JobStream) -> dict:
    labels = engine.labels
    try:
        parsed = JobSpec.model_validate(spec)
        if job.connection.exists(cancel_key(job.id)):
            raise _Cancelled
        with engine.llm.watching(stream.watch):
            result = engine.run(parsed, stream.send)
    except (_Cancelled, JobAborted) as e:
        if isinstance(e, JobAborted):  # stopped mid-prompt: what the sequence holds is a part of it
            engine.forget_context()
            log.info("job.aborted", extra={"job": job.id, "reason": str(e)})
        metrics.JOBS.labels(**labels, outcome=metrics.JobOutcome.CANCELLED).inc()
        return {"finish_reason": "cancelled"}
    except (JobRejected, ValidationError) as e:
        job.retries_left = 0
        reason = f"rejected: {e}" if isinstance(e, JobRejected) else f"rejected: bad job: {e.errors()[0]['msg']}"
        stream.send(ErrorEvent(error=reason, retrying=False))
        metrics.JOBS.labels(**labels, outcome=metrics.JobOutcome.REJECTED).inc()
        log.warning("job.rejected", extra={"job": job.id, "reason": reason})
        raise JobRejected(reason) from None
    except Exception as e:
        engine.forget_context()
        retrying = bool(job.retries_left)
        stream.send(ErrorEvent(error=f"{type(e).__name__}: {e}", retrying=retrying))
        metrics.JOBS.labels(**labels, outcome=metrics.JobOutcome.ERROR).inc()
        log.exception("job.failed", extra={"job": job.id, "retrying": retrying})
        raise
    stream.send(DoneEvent(result=result))
    engine.after_answer()
    engine.settle(
        lambda: jobs_waiting(job.connection, [worker_queue(engine.name), engine.settings.queue]) or pool_busy(job.connection, engine.name)
    )
    metrics.JOBS.labels(**labels, outcome=metrics.JobOutcome(result.finish_reason)).inc()
    log.info(
        "job.done",
        extra={
            "job": job.id,
            "finish_reason": result.finish_reason,
            "prompt_tokens": result.usage.prompt_tokens,
            "cached_context": result.usage.cached_from_context,
            "cached_store": result.usage.cached_from_store,
            "restore_choice": result.restore_choice,
            "completion_tokens": result.usage.completion_tokens,
            "ttft_s": round(result.timings.first_token_s, 4),
            "total_s": round(result.timings.total_s, 4),
        },
    )
    return json.loads(result.model_dump_json())


def jobs_waiting(conn: redis.Redis, queues: list[str]) -> bool:
    """Whether any of ``queues`` holds a job (an unreachable Redis counts as yes: do nothing optional)."""
    try:
        pipe = conn.pipeline(transaction=False)
        for name in queues:
            pipe.llen(Queue(name, connection=conn).key)
        return any(pipe.execute())
    except redis.RedisError:
        return True


def pool_busy(conn: redis.Redis, me: str) -> bool:
    """Whether another worker is running a job: idle-time work on shared cores would slow it down several-fold.

    llama.cpp's threads spin while they wait for each other, so two workers evaluating at
    once on the same cores each run far slower than half speed.
    """
    try:
        return any(a.busy for a in adverts(conn) if a.worker != me)
    except redis.RedisError:
        return True


class _Cancelled(Exception):
    pass
