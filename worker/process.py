"""The worker process: an RQ worker that loads the model once and runs jobs in-process.

* It listens on its own queue first (the gateway routes a request there when this
  worker's context holds its prefix), then on the shared queue.
* It does not fork per job (`rq.SimpleWorker`): the model stays loaded.
* While a job runs, a thread keeps the job's heartbeat short-lived, so that when the
  worker dies (SIGKILL) the job is seen as abandoned within seconds and retried by
  another worker (RQ's retries; `job_attempts` in all). Jobs left in the private queue
  of a dead worker are moved to the shared queue.
* SIGTERM: a warm shutdown -- the current job finishes, then the process exits; jobs
  still waiting in its own queue are handed to the shared queue. The stop is a flag of
  every sequence's RQ worker, checked before each pop and before a popped job starts;
  a wait for a job is woken at once (`worker.stopping`), so an idle worker of any
  number of sequences exits within a second or two. A stop while the process starts
  ends it before it takes a job, exit 0 with nothing left registered. While Redis is
  unreachable there is no job to finish and nothing can be handed back: a stop request
  ends the wait for Redis at once and the process exits 0 (its advert expires, and the
  other workers move what waits in its queue).
* With ``metrics_port`` set, one port serves /metrics, /healthz and /readyz
  (`worker.health`): ready once the model is loaded, the self-check has passed and the
  worker is registered.
* A worker restarted after a crash starts at once under the same name: the registration
  its dead predecessor left in Redis is recognised (same host, process gone, or no
  heartbeat for `STALE_S`) and cleared. A live worker of the same name is refused,
  before the model is loaded. ``worker.ready`` is logged only once the worker is
  registered and can take jobs.
* Redis going away (a restart, a failover) does not end the process: the worker waits
  for it (redis-py's `Retry`, with exponential backoff), registers again and goes on; the
  job it was running is retried by RQ.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job
from rq.timeouts import TimerDeathPenalty
from rq.worker import WorkerStatus

from store.errors import StoreError
from store.store import Store
from worker import jobs, metrics
from worker.advert import Serving, advertise, withdraw
from worker.cpus import available_cpus, openmp_wait
from worker.engine import Engine
from worker.health import Health, self_check_outcome, serve
from worker.models.fetch import resolve_model
from worker.protocol import slot_names, worker_queue
from worker.registration import claim_name, rescue_orphaned_queues
from worker.settings import WorkerSettings
from worker.starting import StartingNotice
from worker.stopping import PUBSUB_WAIT_S, StopAwareQueue, client_name, push_back, wake

log = logging.getLogger("kvpool.worker")
T = TypeVar("T")


class KvpoolWorker(SimpleWorker):
    live: set[KvpoolWorker] = set()
    """This process's RQ workers, one per sequence (`worker.slots`): a stop request reaches all of them."""
    queue_class = StopAwareQueue
    heartbeat_s: float = 2.0
    engine: Engine | None = None
    busy: bool = False
    stopping: bool = False
    waiting: bool = False
    """Between two attempts to reach Redis (`_wait_for_redis`)."""
    health: Health | None = None

    def _install_signal_handlers(self) -> None:
        """Only the main thread's worker takes signals; it passes a stop on to the others (`request_stop`)."""
        if threading.current_thread() is threading.main_thread():
            super()._install_signal_handlers()  # type: ignore[no-untyped-call]
        else:
            self.death_penalty_class = TimerDeathPenalty  # SIGALRM reaches only the main thread

    def request_stop(self, signum, frame):  # type: ignore[no-untyped-def]
        """A warm stop of every sequence's worker: flags, and their waits for a job woken (`worker.stopping`)."""
        jobs.STOPPING.set()
        everyone = list(KvpoolWorker.live | {self})
        for w in everyone:
            w.stopping = w._stop_requested = True
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
        if self.engine is None:
            return
        try:
            e = self.engine
            serving = Serving(e.fingerprint, e.settings.chunk_size, e.layout.canonical(), e.kernels.canonical(), str(e.decode))
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
        """An idle worker asked to stop while Redis is away stops here (`worker.stopping`)."""
        try:
            super().heartbeat(timeout, pipeline)
        except (redis.ConnectionError, redis.TimeoutError):
            if pipeline is None and self._stop_requested and not self.busy:
                raise StopRequested() from None
            raise
        if pipeline is None and not self.busy:
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


def open_store(settings: WorkerSettings) -> Store | None:
    try:
        return Store.open(settings)
    except StoreError as e:
        log.error("store.unavailable_at_start", extra={"reason": str(e)})
        return None


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


def _stop_while_starting(signum, frame) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM or SIGINT before the main sequence's RQ worker takes signals (`KvpoolWorker.bootstrap`).

    The stop is noted, not raised: the batcher's thread may be running the start-up checks in
    the context, which must be closed, not freed under it. A worker still loading stops once
    its engines are built, having taken no job and registered nothing (`run_worker`); one
    waiting for Redis stops at once (`_wait_for_redis`); a sequence already started stops as
    it starts, through RQ's teardown.
    """
    log.info("worker.stop_requested", extra={"phase": "starting"})
    jobs.STOPPING.set()
    for w in list(KvpoolWorker.live):
        w.stopping = w._stop_requested = True


def run_worker(settings: WorkerSettings, *, burst: bool = False) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_while_starting)
    health = Health(ping=redis.Redis.from_url(settings.redis_url, socket_connect_timeout=1, socket_timeout=1).ping)
    if settings.metrics_port is not None:
        serve(health, settings.metrics_port)  # /healthz answers while the model loads
    notice = StartingNotice(settings.redis_url)
    try:
        with notice:  # until its first advert, the pool sees it as starting
            workers, engines = _start(settings, health)
    except StopRequested:  # stopped while Redis was unreachable
        log.info("worker.stopped", extra={"phase": "starting", "redis": "unreachable"})
        return
    others = [
        threading.Thread(target=_serve, args=(settings, w, e, None, burst), name=f"kvpool-{w.name}")
        for w, e in zip(workers[1:], engines[1:], strict=True)
    ]
    try:
        if jobs.STOPPING.is_set():  # stopped while the model loaded
            notice.withdraw()
            log.info("worker.stopped", extra={"phase": "starting"})
            return
        for t in others:
            t.start()
        _serve(settings, workers[0], engines[0], health, burst)
    finally:
        for t in others:
            if t.is_alive():
                t.join()
        for e in reversed(engines):  # the first opened the context: it closes last
            e.close()


def _start(settings: WorkerSettings, health: Health) -> tuple[list[KvpoolWorker], list[Engine]]:
    """The sequences' RQ workers (their names claimed) and engines (the model loaded, the start-up checks run)."""
    names = slot_names(settings.worker_name or f"{socket.gethostname()}-{os.getpid()}", settings.parallel)
    workers = [_wait_for_redis(lambda n=n: build_worker(settings, n)) for n in names]
    for w in workers:
        w.health = health if w is workers[0] else None
        _wait_for_redis(w.claim_name)
    log.info(
        "worker.threads",
        extra={
            "n_threads": settings.n_threads,
            "n_threads_batch": settings.threads_batch(),
            "cpus": available_cpus(),
            "openmp": openmp_wait(),
            "parallel": settings.parallel,
        },
    )
    engine = Engine(settings, resolve_model(settings), store=open_store(settings), name=names[0])
    engines = [engine, *(engine.for_sequence(seq, name) for seq, name in enumerate(names[1:], start=1))]
    metrics.BUSY.labels(**engine.labels).set(0)
    outcome, passed = self_check_outcome(
        engine.kv.cuttable or engine.checkpoints is not None, settings.self_check, engine.restore_enabled, engine.exact
    )
    health.model_loaded(self_check=outcome, passed=passed, identity={"layout": engine.layout.canonical(), **engine.identity()})
    return workers, engines


def _serve(settings: WorkerSettings, worker: KvpoolWorker, engine: Engine, health: Health | None, burst: bool) -> None:
    """One sequence's RQ worker loop, through Redis outages, until it is stopped (or, in burst mode, the queues are empty)."""
    redis_away = False
    jobs.bind(engine)
    try:
        while True:
            worker.engine = engine
            _wait_for_redis(lambda worker=worker: worker.work(burst=burst, with_scheduler=False, logging_level=_log_level()), worker)
            if health is not None:
                health.registered(False)
            if burst or worker.stopping:
                break
            log.warning("worker.restarting", extra={"worker": worker.name, "reason": "the RQ loop ended (Redis lost?)"})
            _pause(worker, 1.0)  # a loop that keeps ending must not spin
            KvpoolWorker.live.discard(worker)
            worker = _wait_for_redis(lambda name=worker.name: build_worker(settings, name), worker)  # the old one holds the signal handlers
            worker.health = health
    except StopRequested:
        redis_away = True
        log.info("worker.stopped", extra={"worker": worker.name, "redis": "unreachable"})
    finally:
        KvpoolWorker.live.discard(worker)
        if not redis_away:
            _leave(worker)


def _leave(worker: KvpoolWorker) -> None:
    """Withdraw the advert, then hand the jobs still waiting in this worker's own queue to the shared one.

    Without the hand-over they would wait for another worker's maintenance to find them,
    and a pool scaled to zero on the shared queue's length has no other worker.
    """
    try:
        withdraw(worker.connection, worker.name)
        rescue_orphaned_queues(worker.connection, worker.queues[-1])
    except redis.RedisError:
        pass


def _log_level() -> str:
    return logging.getLevelName(logging.getLogger().level)


def _wait_for_redis(call: Callable[[], T], worker: KvpoolWorker | None = None, max_wait_s: float = 2.0) -> T:
    """Run ``call``, waiting for Redis (redis-py's `Retry`, backoff up to ``max_wait_s``) while it is unreachable.

    A stop request to ``worker`` ends the wait at once with `StopRequested`: raised by the
    signal handler during a back-off, or here at the next failure when the signal came
    during an attempt (RQ's own warm shutdown then failed on the unreachable Redis). A
    stop while the process starts (`_stop_while_starting`) ends it at the next failure.
    """
    retry = Retry(ExponentialBackoff(cap=max_wait_s, base=0.125), -1, (redis.ConnectionError, redis.TimeoutError))

    def attempt() -> T:
        _set_waiting(worker, False)
        return call()

    def failed(e: Exception) -> None:
        if jobs.STOPPING.is_set() or (worker is not None and worker.stopping):
            raise StopRequested()
        log.warning("redis.unavailable", extra={"reason": str(e)})
        _set_waiting(worker, True)

    try:
        return retry.call_with_retry(attempt, failed)
    finally:
        _set_waiting(worker, False)


def _set_waiting(worker: KvpoolWorker | None, waiting: bool) -> None:
    if worker is not None:
        worker.waiting = waiting


def _pause(worker: KvpoolWorker, seconds: float) -> None:
    """Sleep; a stop request ends it at once."""
    worker.waiting = True
    try:
        time.sleep(seconds)
    finally:
        worker.waiting = False
