"""Running a planned batch: leaders first, siblings as RQ dependents, a bounded number in flight."""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from pydantic import ValidationError

from gateway.batch.lines import result_record
from gateway.batch.plan import Group, Request
from gateway.batch.results import Results, Tally
from gateway.dispatch import Dispatcher
from gateway.errors import APIError, Overloaded, WorkerFailed
from gateway.responses import chat_body, completion_body
from gateway.settings import GatewaySettings
from worker.advert import adverts
from worker.client import ENDED, JobStatus, cancel, delete_job, job_key, job_status, requeue_stranded, return_value, take_events
from worker.protocol import (
    STREAM_PREFIX,
    DoneEvent,
    ErrorEvent,
    JobResult,
    Once,
    StartEvent,
    TokenEvent,
    stream_key,
)

log = logging.getLogger("kvpool.batch")


CHECK_EVERY_S = 2.0
POLL_BLOCK_MS = 500


class BatchAborted(Exception):
    """The batch cannot go on (no worker, no progress); what is answered stays answered, a rerun resumes.

    Control flow, not an API error: no request failed, so nothing is answered with it. The
    command prints it and exits 1; the batch service leaves the batch active to try later.
    """


@dataclass
class Flight:
    """A submitted job not yet answered."""

    request: Request
    group: Group
    leader: bool
    job_id: str
    last: str = "0"
    tokens: list[TokenEvent] = field(default_factory=list)
    once: Once = field(default_factory=Once)


class Runner:
    """Submits the groups' jobs within a bounded window and turns their events into result lines.

    One thread reads the streams of every job in flight with a single XREAD. Every few
    seconds it also asks RQ about those jobs (one that failed or vanished without a final
    event) and checks that some worker is still alive.
    """

    def __init__(
        self,
        conn: redis.Redis[bytes],
        settings: GatewaySettings,
        model_name: str,
        groups: list[Group],
        out: Results,
        tally: Tally,
        *,
        window: int,
        worker_grace_s: float,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.conn = conn
        self.settings = settings
        self.dispatcher = Dispatcher(conn, settings)
        self.model_name = model_name
        self.out = out
        self.tally = tally
        self.window = window
        self.early_cap = max(1, window // 2)
        self.worker_grace_s = worker_grace_s
        self.on_change = on_change
        self.flights: dict[str, Flight] = {}
        self.pending = sum(1 + len(g.siblings) for g in groups)
        self._leaders: deque[Group] = deque(groups)
        self._early: deque[Group] = deque()
        self._ready: deque[Group] = deque()
        self._backoff_until = 0.0
        self._next_check = 0.0
        self._no_worker_since: float | None = None
        self._progress_at = time.monotonic()

    def run(self) -> None:
        while self.pending or self.flights:
            self._fill()
            if self.flights:
                self._poll(POLL_BLOCK_MS)
            else:
                time.sleep(min(0.5, max(0.05, self._backoff_until - time.monotonic())))
            if time.monotonic() >= self._next_check:
                self._next_check = time.monotonic() + CHECK_EVERY_S
                self._check()

    def cancel_all(self) -> None:
        """Ask the workers to drop every job in flight (a job not yet started is dropped when it starts)."""
        for job_id in self.flights:
            try:
                cancel(self.conn, job_id)
            except redis.RedisError:
                break

    # submitting

    def _pick(self) -> tuple[Group, bool] | None:
        """Next to submit: a leader, else a sibling whose leader is done, else (bounded) one whose leader runs."""
        if self._leaders:
            return self._leaders.popleft(), True
        while self._ready:
            g = self._ready.popleft()
            if g.siblings:
                return g, False
        early = sum(1 for f in self.flights.values() if not f.leader and not f.group.leader_done)
        while self._early and early < self.early_cap:
            g = self._early.popleft()
            if g.siblings and g.leader_running:
                return g, False
        return None

    def _fill(self) -> None:
        while self.pending and len(self.flights) < self.window and time.monotonic() >= self._backoff_until:
            pick = self._pick()
            if pick is None:
                return
            group, leader = pick
            if not self._submit(group, leader):
                (self._leaders if leader else self._ready if group.leader_done else self._early).appendleft(group)
                return
            if leader and group.siblings:
                self._early.append(group)
            elif not leader and group.siblings:
                (self._ready if group.leader_done else self._early).append(group)

    def _submit(self, group: Group, leader: bool) -> bool:
        request = group.leader if leader else group.siblings[0]
        assert request is not None
        spec = request.prepared.spec.model_copy(update={"enqueued_at": time.time(), "wait_for_publish": leader and bool(group.siblings)})
        depends_on = group.leader_job if not leader and group.leader_running else None
        job_id = f"batch-{uuid.uuid4().hex}"
        try:
            self.dispatcher.dispatch(spec, depends_on=depends_on, job_id=job_id)
        except Overloaded as e:
            self._backoff_until = time.monotonic() + float(e.headers.get("Retry-After", "2"))
            log.debug("batch.backoff", extra={"code": e.code, "retry_after_s": e.headers.get("Retry-After")})
            return False
        if leader:
            group.leader_job = job_id
        else:
            group.siblings.popleft()
        self.pending -= 1
        self.flights[job_id] = Flight(request, group, leader, job_id)
        self._progress_at = time.monotonic()
        log.debug("batch.submitted", extra={"job": job_id, "line": request.line, "leader": leader, "depends_on": depends_on})
        return True

    # events

    def _poll(self, block_ms: int | None, only: str | None = None) -> None:
        ids = [only] if only is not None else list(self.flights)
        reply = self.conn.xread({stream_key(j): self.flights[j].last for j in ids}, count=256, block=block_ms)
        for key, entries in reply or []:
            job_id = (key.decode() if isinstance(key, bytes) else key)[len(STREAM_PREFIX) :]
            for entry_id, fields in entries:
                flight = self.flights.get(job_id)
                if flight is None:
                    break
                flight.last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                self._progress_at = time.monotonic()
                for event in take_events(flight.once, fields):
                    self._on_event(flight, event)

    def _on_event(self, flight: Flight, ev: object) -> None:
        if isinstance(ev, StartEvent):
            flight.tokens.clear()
        elif isinstance(ev, TokenEvent):
            if flight.request.want_logprobs:
                flight.tokens.append(ev)
        elif isinstance(ev, ErrorEvent):
            if not ev.retrying:
                self._failed(flight, WorkerFailed(f"the worker failed: {ev.error}", code="worker_error"))
        elif isinstance(ev, DoneEvent):
            self._answered(flight, ev.result)

    def _answered(self, flight: Flight, result: JobResult) -> None:
        r = flight.request
        if r.prepared.chat:
            body = chat_body(flight.job_id, self.model_name, result, flight.tokens, r.want_logprobs, tools=r.prepared.tools)
        else:
            body = completion_body(flight.job_id, self.model_name, result, flight.tokens, r.want_logprobs, echo=r.prepared.echo)
        self.out.write(result_record(r.result_id, r.custom_id, response={"status_code": 200, "request_id": flight.job_id, "body": body}))
        self.tally.add(r, result)
        del self.flights[flight.job_id]
        if flight.leader:
            flight.group.leader_done = True
            if flight.group.siblings:
                self._ready.append(flight.group)
        log.debug(
            "batch.answered",
            extra={
                "job": flight.job_id,
                "line": r.line,
                "leader": flight.leader,
                "cached": result.usage.cached_tokens,
                "ideal": r.ideal,
                "worker": result.worker,
            },
        )
        self.on_change()

    def _failed(self, flight: Flight, error: APIError) -> None:
        r = flight.request
        self.out.write(
            result_record(
                r.result_id, r.custom_id, response={"status_code": error.status, "request_id": flight.job_id, "body": error.body()}
            )
        )
        self.tally.failed += 1
        del self.flights[flight.job_id]
        log.warning("batch.request_failed", extra={"job": flight.job_id, "line": r.line, "status": error.status, "reason": error.message})
        if flight.leader:
            self._promote(flight.group)
        self.on_change()

    def _promote(self, group: Group) -> None:
        """The leader failed, so RQ will never release its dependents: withdraw them and let the next member lead."""
        waiting = [f for f in self.flights.values() if f.group is group and not f.leader]
        for f in waiting:
            cancel(self.conn, f.job_id)
            delete_job(self.conn, f.job_id)
            del self.flights[f.job_id]
        group.siblings.extendleft(reversed([f.request for f in waiting]))
        self.pending += len(waiting)
        group.leader_job = None
        group.leader = group.siblings.popleft() if group.siblings else None
        if group.leader is not None:
            self._leaders.appendleft(group)
        log.info("batch.leader_promoted", extra={"withdrawn": len(waiting), "new_leader_line": group.leader.line if group.leader else None})

    # health

    def _check(self) -> None:
        self._check_jobs()
        now = time.monotonic()
        if adverts(self.conn):
            self._no_worker_since = None
        elif self._no_worker_since is None:
            self._no_worker_since = now
            log.warning("batch.no_worker", extra={"grace_s": self.worker_grace_s})
        elif now - self._no_worker_since > self.worker_grace_s:
            raise BatchAborted(
                f"no live worker for {self.worker_grace_s:.0f} s; start workers with `kvpool worker` and rerun the same command to resume"
            )
        if self.flights and now - self._progress_at > self.settings.request_timeout_s:
            raise BatchAborted(
                f"no progress for {self.settings.request_timeout_s:.0f} s with {len(self.flights)} jobs in flight; "
                f"are the workers serving queue {self.settings.queue!r}? Rerun the same command to resume"
            )

    def _check_jobs(self) -> None:
        """Settle jobs RQ says are over but whose final event never came (failed before writing one, or expired);
        put back those a dying worker popped (`requeue_stranded`)."""
        ids = list(self.flights)
        if not ids:
            return
        pipe = self.conn.pipeline(transaction=False)
        for j in ids:
            pipe.hget(job_key(j), "status")
        for job_id, raw in zip(ids, pipe.execute()):
            status = job_status(raw)
            if status == JobStatus.QUEUED and requeue_stranded(self.conn, job_id, self.settings.queue):
                log.warning("batch.job_stranded", extra={"job": job_id, "reason": "a worker popped it and died before starting it"})
            if status is not None and status not in ENDED:
                continue
            if job_id not in self.flights:
                continue
            self._poll(None, only=job_id)
            flight = self.flights.get(job_id)
            if flight is None:
                continue
            if status == JobStatus.FINISHED:
                result = _return_value(self.conn, job_id)
                if result is not None:
                    self._answered(flight, result)
                    continue
            self._failed(
                flight,
                WorkerFailed(f"the job ended ({status.value if status else 'gone from the queue'}) without an answer", code="worker_error"),
            )


def _return_value(conn: redis.Redis[bytes], job_id: str) -> JobResult | None:
    value = return_value(conn, job_id)
    try:
        return JobResult.model_validate(value)
    except ValidationError:
        return None
