"""The worker process: an RQ worker that loads the model once and runs jobs in-process.

* It listens on its own queue first (the gateway routes a request there when this
  worker's context holds its prefix), then on the shared queue.
* It does not fork per job (`rq.SimpleWorker`): the model stays loaded.
* While a job runs, a thread keeps the job's heartbeat short-lived, so that when the
  worker dies (SIGKILL) the job is seen as abandoned within seconds and retried by
  another worker (RQ's retries; `job_attempts` in all). Jobs left in the private queue
  of a dead worker are moved to the shared queue.
* SIGTERM: RQ's warm shutdown -- the current job finishes, then the process exits.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path

import redis
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.worker import WorkerStatus

from store.errors import StoreError
from store.store import Store
from worker import jobs
from worker.advert import advertise, adverts, withdraw
from worker.engine import Engine
from worker.protocol import WORKER_QUEUE_PREFIX, worker_queue
from worker.settings import WorkerSettings

log = logging.getLogger("kvpool.worker")


class KvpoolWorker(SimpleWorker):
    heartbeat_s: float = 2.0
    engine: Engine | None = None
    busy: bool = False

    def advertise(self, busy: bool) -> None:
        if self.engine is None:
            return
        try:
            advertise(self.connection, self.name, self.engine.held_keys(), busy)
        except redis.RedisError as e:
            log.warning("advert.failed", extra={"reason": str(e)})

    def heartbeat(self, timeout: int | None = None, pipeline=None):  # type: ignore[no-untyped-def]
        super().heartbeat(timeout, pipeline)
        if pipeline is None and not self.busy:
            self.advertise(busy=False)

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return int(self.heartbeat_s * 3) + 2

    def execute_job(self, job: Job, queue: Queue) -> None:
        execution = self.prepare_execution(job)
        self.busy = True
        self.advertise(busy=True)
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.heartbeat_s):
                try:
                    self.maintain_heartbeats(job, execution)
                except redis.RedisError as e:
                    log.warning("heartbeat.failed", extra={"reason": str(e)})
                self.advertise(busy=True)

        thread = threading.Thread(target=beat, name="kvpool-heartbeat", daemon=True)
        thread.start()
        try:
            self.perform_job(job, queue, execution)
        finally:
            done.set()
            thread.join()
        self.set_state(WorkerStatus.IDLE)
        self.busy = False
        self.advertise(busy=False)

    def run_maintenance_tasks(self) -> None:
        super().run_maintenance_tasks()
        try:
            rescue_orphaned_queues(self.connection, self.queues[-1])
        except redis.RedisError as e:
            log.warning("rescue.failed", extra={"reason": str(e)})


def rescue_orphaned_queues(conn: redis.Redis, shared: Queue) -> int:
    """Move jobs from the private queues of workers that are gone (their advert expired) to the shared queue."""
    alive = {a.worker for a in adverts(conn)}
    moved = 0
    for q in Queue.all(connection=conn):
        if not q.name.startswith(WORKER_QUEUE_PREFIX) or q.name[len(WORKER_QUEUE_PREFIX) :] in alive:
            continue
        StartedJobRegistry(queue=q).cleanup()
        for job_id in q.get_job_ids():
            job = Job.fetch(job_id, connection=conn)
            q.remove(job_id)
            job.origin = shared.name
            job.save()
            shared.enqueue_job(job)
            moved += 1
        if moved:
            log.info("rescue.moved", extra={"from": q.name, "jobs": moved})
    return moved


def resolve_model(settings: WorkerSettings) -> Path:
    """The model file to load: a path, an ``s3://`` URL (downloaded once), or the packaged SmolLM2 by default."""
    if not settings.model:
        from worker.packaged import DEFAULT_MODEL, ensure_packaged

        return ensure_packaged(DEFAULT_MODEL, settings.state_dir / "models")
    if settings.model.startswith("s3://"):
        from worker.model_fetch import fetch_model

        return fetch_model(settings.model, settings)
    path = Path(settings.model)
    if not path.is_file():
        raise FileNotFoundError(f"model not found: {path}")
    return path


def open_store(settings: WorkerSettings) -> Store | None:
    try:
        return Store.open(settings)
    except StoreError as e:
        log.error("store.unavailable_at_start", extra={"reason": str(e)})
        return None


def build_worker(settings: WorkerSettings, *, burst: bool = False) -> tuple[KvpoolWorker, Engine]:
    name = settings.worker_name or f"{socket.gethostname()}-{os.getpid()}"
    conn = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=settings.connect_timeout_s)
    engine = Engine(settings, resolve_model(settings), store=open_store(settings), name=name)
    jobs.set_engine(engine)
    queues = [Queue(worker_queue(name), connection=conn), Queue(settings.queue, connection=conn)]
    worker = KvpoolWorker(queues, connection=conn, name=name, worker_ttl=20, maintenance_interval=5, log_job_description=False)
    worker.heartbeat_s = settings.heartbeat_s
    worker.engine = engine
    return worker, engine


def run_worker(settings: WorkerSettings, *, burst: bool = False) -> None:
    worker, engine = build_worker(settings, burst=burst)
    if settings.metrics_port is not None:
        from prometheus_client import start_http_server

        server, _ = start_http_server(settings.metrics_port)
        log.info("metrics.serving", extra={"port": server.server_port})
    log.info(
        "worker.ready",
        extra={"worker": worker.name, "model": engine.labels["model"], "layout": engine.labels["layout"], "restore": engine.restore_enabled},
    )
    try:
        worker.work(burst=burst, with_scheduler=False, logging_level=logging.getLevelName(logging.getLogger().level))
    finally:
        withdraw(worker.connection, worker.name)
        engine.close()
        jobs.set_engine(None)
