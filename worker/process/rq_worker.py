"""One sequence's RQ worker: the model's engine, its own queue before the shared one, its heartbeat and advert.

A worker process runs one per sequence of its context (`worker.process.main`, `worker.engine.context`).
It does not fork per job (`rq.SimpleWorker`): the model stays loaded. While a job runs, a
thread keeps the job's heartbeat short-lived, so that when the worker dies (SIGKILL) the
job is seen as abandoned within seconds and retried by another worker. How it stops is
`worker.process.stopping`.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import redis
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job
from rq.timeouts import TimerDeathPenalty
from rq.worker import WorkerStatus

from worker import metrics
from worker.advert import Serving, advertise
from worker.answering import Engine
from worker.process import jobstream
from worker.process.health import Health
from worker.process.registration import claim_name, rescue_orphaned_queues
from worker.process.stopping import PUBSUB_WAIT_S, StopAwareQueue, client_name, push_back, wake
from worker.protocol import worker_queue
from worker.settings import WorkerSettings

log = logging.getLogger("kvpool.worker")


class KvpoolWorker(SimpleWorker):
    live: set[KvpoolWorker] = set()
    """This process's RQ workers, one per sequence (`worker.engine.context`): a stop request reaches all of them."""
    queue_class = StopAwareQueue
    heartbeat_s: float = 2.0
    engine: Engine | None = None
    busy: bool = False
    stopping: bool = False
    waiting: bool = False
    """Between two attempts to reach Redis (`_wait_for_redis`)."""
    health: Health | None = None
    idle_advert_at: float = float("-inf")
    """When the worker last advertised itself idle (monotonic): RQ's heartbeats around a pop refresh it at most once
    per ``heartbeat_s``, so the advert costs no round trip between a job's pop and its start (`bench-overhead`)."""

    def _install_signal_handlers(self) -> None:
        """Only the main thread's worker takes signals; it passes a stop on to the others (`request_stop`)."""
        if threading.current_thread() is threading.main_thread():
            super()._install_signal_handlers()  # type: ignore[no-untyped-call]
        else:
            self.death_penalty_class = TimerDeathPenalty  # SIGALRM reaches only the main thread

    def request_stop(self, signum, frame):  # type: ignore[no-untyped-def]
        """A warm stop of every sequence's worker: flags, and their waits for a job woken (`worker.process.stopping`)."""
        everyone = KvpoolWorker.stop_all(also=self)
        if self.health is not None:
            self.health.stopping()
        if self.waiting:  # Redis is away: no job runs and nothing can be handed back, so the wait ends now
            log.info("worker.stop_requested", extra={"worker": self.name, "redis": "unreachable"})
            raise StopRequested()
        super().request_stop(signum, frame)  # RQ's: a second signal is a cold shutdown
        try:
            wake(self.connection, [w.name for w in everyone])
        except redis.RedisError:  # away: RQ's loop sleeps between tries and pops nothing
            if not self.busy:
                raise StopRequested() from None

    @classmethod
    def stop_all(cls, also: KvpoolWorker | None = None) -> list[KvpoolWorker]:
        """Flag every sequence's worker of this process (and ``also``) to stop once its job is done, the process as stopping.

        ``also``: the worker whose signal handler asks; after a restart of its RQ loop it is no longer in ``live``.
        """
        jobstream.STOPPING.set()
        everyone = list(cls.live | ({also} if also is not None else set()))
        for w in everyone:
            w.stopping = w._stop_requested = True
        return everyone

    def _shutdown(self) -> None:
        """RQ's raises `StopRequested` from the signal handler when the worker is idle, wherever the main thread
        is, even just after a pop; here the stop is the flag `request_stop` set, seen before the next pop."""
        if self.busy:
            self.set_shutdown_requested_date()

    def subscribe(self) -> None:
        """RQ's, with a pubsub thread that looks at its stop flag every `PUBSUB_WAIT_S` (RQ's 60 s held a stop up)."""
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=PUBSUB_WAIT_S, daemon=True, exception_handler=self._pubsub_exception_handler
        )

    def bootstrap(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        """Take signals before registering. RQ installs its handlers only after `bootstrap`, while the
        registration and the advert already say the worker is up: a SIGTERM in between killed the process."""
        self._install_signal_handlers()
        super().bootstrap(*args, **kwargs)

    def set_shutdown_requested_date(self) -> None:
        """RQ records a warm shutdown during a job for its dashboards; with Redis away that must not raise inside the job."""
        try:
            super().set_shutdown_requested_date()  # type: ignore[no-untyped-call]
        except redis.RedisError as e:
            log.warning("worker.shutdown_date_not_recorded", extra={"reason": str(e)})

    def advertise(self, busy: bool) -> None:
        """Publish what this sequence's context holds and whether it is busy (`worker.advert`)."""
        if self.engine is None:
            return
        self.idle_advert_at = float("-inf") if busy else time.monotonic()
        try:
            e = self.engine
            serving = Serving(
                e.fingerprint, e.settings.chunk_size, e.layout.canonical(), e.kernels.canonical(), str(e.decode), e.loaded.context.n_seq
            )
            pending = e.publisher.pending if e.publisher else 0
            advertise(
                self.connection, self.name, e.held_keys(), busy, pid=os.getpid(), host=self.hostname or "", serving=serving, pending=pending
            )
        except redis.RedisError as e:
            log.warning("advert.failed", extra={"reason": str(e)})

    def claim_name(self) -> None:
        """Clear the registration a dead worker of this name left behind; refuse if that worker lives."""
        claim_name(self)

    def register_birth(self) -> None:
        self.claim_name()
        super().register_birth()
        self.advertise(busy=False)
        if self.health is not None:
            self.health.registered(True)
        if self.engine is not None:
            log.info(
                "worker.ready",
                extra={
                    "worker": self.name,
                    "model": self.engine.labels["model"],
                    "layout": self.engine.labels["layout"],
                    "kernels": self.engine.kernels.canonical(),
                    "restore": self.engine.restore_enabled,
                },
            )

    def heartbeat(self, timeout: int | None = None, pipeline=None):  # type: ignore[no-untyped-def]
        """An idle worker asked to stop while Redis is away stops here (`worker.process.stopping`)."""
        try:
            super().heartbeat(timeout, pipeline)
        except (redis.ConnectionError, redis.TimeoutError):
            if pipeline is None and self._stop_requested and not self.busy:
                raise StopRequested() from None
            raise
        if pipeline is None and not self.busy and time.monotonic() - self.idle_advert_at >= self.heartbeat_s:
            self.advertise(busy=False)

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return int(self.heartbeat_s * 3) + 2

    def execute_job(self, job: Job, queue: Queue) -> None:
        if self._stop_requested:  # popped as the stop came: another worker runs it
            push_back(job, queue)
            raise StopRequested()
        execution = self.prepare_execution(job)
        self.busy = True
        if self.engine is not None:
            metrics.BUSY.labels(**self.engine.labels).inc()
        done = threading.Event()

        def beat() -> None:  # the first advert of the job too: the job starts without waiting for it
            self.advertise(busy=True)
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
            self.busy = False
            if self.engine is not None:
                metrics.BUSY.labels(**self.engine.labels).dec()
        self.set_state(WorkerStatus.IDLE)
        self.advertise(busy=False)

    def run_maintenance_tasks(self) -> None:
        super().run_maintenance_tasks()
        try:
            rescue_orphaned_queues(self.connection, self.queues[-1])
        except redis.RedisError as e:
            log.warning("rescue.failed", extra={"reason": str(e)})


def build_worker(settings: WorkerSettings, name: str) -> KvpoolWorker:
    """The RQ worker of one sequence; the model is not loaded yet."""
    conn = redis.Redis.from_url(
        settings.redis_url, socket_connect_timeout=settings.connect_timeout_s, health_check_interval=10, client_name=client_name(name)
    )
    queues = [StopAwareQueue(worker_queue(name), connection=conn), StopAwareQueue(settings.queue, connection=conn)]
    worker = KvpoolWorker(queues, connection=conn, name=name, worker_ttl=20, maintenance_interval=5, log_job_description=False)
    worker.heartbeat_s = settings.heartbeat_s
    KvpoolWorker.live.add(worker)
    return worker
