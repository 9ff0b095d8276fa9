"""The worker process: loads the model once, then runs one RQ worker per sequence of its context.

* Each sequence's RQ worker (`worker.process.rq_worker`) listens on its own queue first (the
  gateway routes a request there when that sequence's cells hold its prefix), then on the
  shared queue; the first runs in the main thread (it takes the signals), the others in
  threads. Jobs left in the private queue of a dead worker are moved to the shared queue.
* SIGTERM: a warm shutdown -- the current job finishes, then the process exits; jobs
  still waiting in its own queue are handed to the shared queue. The stop is a flag of
  every sequence's RQ worker, checked before each pop and before a popped job starts;
  a wait for a job is woken at once (`worker.process.stopping`), so an idle worker of any
  number of sequences exits within a second or two. A stop while the process starts
  ends it before it takes a job, exit 0 with nothing left registered. While Redis is
  unreachable there is no job to finish and nothing can be handed back: a stop request
  ends the wait for Redis at once and the process exits 0 (its advert expires, and the
  other workers move what waits in its queue).
* Every thread is supervised (`worker.process.supervision`): one that dies stops the process as
  SIGTERM does, ``/readyz`` turns false at once, and the process exits 1.
* With ``metrics_port`` set, one port serves /metrics, /healthz and /readyz
  (`worker.process.health`): ready once the model is loaded, the self-check has passed and the
  worker is registered.
* A worker restarted after a crash starts at once under the same name: the registration
  its dead predecessor left in Redis is recognised (`worker.process.registration`) and cleared.
  A live worker of the same name is refused, before the model is loaded.
  ``worker.ready`` is logged only once the worker is registered and can take jobs.
* Redis going away (a restart, a failover) does not end the process: the worker waits
  for it (redis-py's `Retry`, with exponential backoff), registers again and goes on; the
  job it was running is retried by RQ.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from rq.exceptions import StopRequested

from store.errors import StoreError
from store.store import Store
from worker import metrics
from worker.advert import withdraw
from worker.answering import Engine
from worker.cpus import available_cpus, openmp_wait
from worker.engine.context import flash_attn_for, sequences_for
from worker.models.fetch import resolve_model
from worker.process import jobs, jobstream
from worker.process.health import Health, self_check_outcome, serve
from worker.process.registration import rescue_orphaned_queues
from worker.process.rq_worker import KvpoolWorker, build_worker
from worker.process.starting import StartingNotice
from worker.process.stopping import wake
from worker.process.supervision import Supervisor
from worker.protocol import slot_names
from worker.settings import WorkerSettings

log = logging.getLogger("kvpool.worker")
T = TypeVar("T")


def open_store(settings: WorkerSettings) -> Store | None:
    try:
        return Store.open(settings)
    except StoreError as e:
        log.error("store.unavailable_at_start", extra={"reason": str(e)})
        return None


def _stop_while_starting(signum, frame) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM or SIGINT before the main sequence's RQ worker takes signals (`KvpoolWorker.bootstrap`).

    The stop is noted, not raised: the engine loop's thread may be running the start-up checks in
    the context, which must be closed, not freed under it. A worker still loading stops once
    its engines are built, having taken no job and registered nothing (`run_worker`); one
    waiting for Redis stops at once (`_wait_for_redis`); a sequence already started stops as
    it starts, through RQ's teardown.
    """
    log.info("worker.stop_requested", extra={"phase": "starting"})
    KvpoolWorker.stop_all()


def _stop_for_good(health: Health, thread: str) -> None:
    """A thread died (`worker.process.supervision`): unready at once, and every sequence stops as on SIGTERM."""
    health.failed(f"a thread of the worker died ({thread}); the worker is stopping")
    everyone = KvpoolWorker.stop_all()
    if everyone:
        try:
            wake(everyone[0].connection, [w.name for w in everyone])
        except redis.RedisError:
            pass  # away: the RQ loops stop at their next failed heartbeat


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
    supervisor = Supervisor(on_death=lambda thread: _stop_for_good(health, thread))
    engines[0].loaded.context.loop.on_death = supervisor.died
    jobstream.Emitter.on_death = supervisor.died
    others = [
        supervisor.thread(partial(_serve, settings, w, e, None, burst), f"kvpool-{w.name}")
        for w, e in zip(workers[1:], engines[1:], strict=True)
    ]
    try:
        if jobstream.STOPPING.is_set():  # stopped while the model loaded
            notice.withdraw()
            log.info("worker.stopped", extra={"phase": "starting"})
            return
        for t in others:
            t.start()
        try:
            _serve(settings, workers[0], engines[0], health, burst)
        except Exception as e:
            supervisor.died(workers[0].name, e)
    finally:
        for t in others:
            if t.is_alive():
                t.join()
        for engine in reversed(engines):  # the first opened the context: it closes last
            engine.close()
    supervisor.check()


def _start(settings: WorkerSettings, health: Health) -> tuple[list[KvpoolWorker], list[Engine]]:
    """The sequences' RQ workers (their names claimed) and engines (the model loaded, the start-up checks run)."""
    model = resolve_model(settings)
    settings = settings.model_copy(  # 0 and unset: chosen for the model
        update={"parallel": sequences_for(model, settings.parallel), "flash_attn": flash_attn_for(model, settings.flash_attn)}
    )
    names = slot_names(settings.worker_name or f"{socket.gethostname()}-{os.getpid()}", settings.parallel)
    workers = [_wait_for_redis(partial(build_worker, settings, n)) for n in names]
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
    engine = Engine.open(settings, model, store=open_store(settings), name=names[0])
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
            _wait_for_redis(partial(worker.work, burst=burst, with_scheduler=False, logging_level=_log_level()), worker)
            if health is not None:
                health.registered(False)
            if burst or worker.stopping:
                break
            log.warning("worker.restarting", extra={"worker": worker.name, "reason": "the RQ loop ended (Redis lost?)"})
            _pause(worker, 1.0)  # a loop that keeps ending must not spin
            KvpoolWorker.live.discard(worker)
            worker = _wait_for_redis(partial(build_worker, settings, worker.name), worker)  # the old one holds the signal handlers
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
        if jobstream.STOPPING.is_set() or (worker is not None and worker.stopping):
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
