"""``kvpool batch``: answer a file of OpenAI batch requests over the worker pool, prefix-aware and resumable.

Input lines are OpenAI batch requests (``custom_id``, ``method``, ``url``, ``body``);
output lines are OpenAI batch results, appended, flushed and fsynced one by one as
requests finish. Every result carries an id derived from its request (its ``custom_id``,
or for a line that has no usable one, its number and text), so a rerun of the same
command after an interruption skips whatever the output file already answers.

Scheduling is prefix-aware. Two requests that share any full chunk share the first one,
so requests are grouped by the first key of their chain. Each group's leader (the member
sharing the most chunks with the others) runs first with ``wait_for_publish``; its
siblings are RQ dependents of its job and fan out over every worker once its chunks are
in the store, so a shared prefix is evaluated once per batch rather than once per worker.
The number of jobs submitted and not yet answered stays bounded, so a batch never fills
the queues that interactive requests go through.

What whole-chunk sharing allows (the "ideal"): for each request, the full chunks it shares
with a request scheduled before it in its group, at most its prompt less one token (the
last prompt token is always evaluated). The summary compares reused tokens with it.

Bodies are checked and prepared exactly as the HTTP API does it; ``stream`` is ignored
(a result is always a whole response).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, BinaryIO

import click
import redis
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text
from rq.job import Job, JobStatus

from gateway.dispatch import Dispatcher
from gateway.errors import APIError, InvalidRequest, Overloaded, WorkerFailed
from gateway.prepare import Prepared, Preparer
from gateway.responses import chat_body, completion_body
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.settings import GatewaySettings
from gateway.tenants import DEFAULT_TENANT, Tenant, Tenants
from worker.advert import adverts
from worker.client import cancel, parse_event
from worker.protocol import STREAM_PREFIX, DoneEvent, ErrorEvent, JobResult, StartEvent, TokenEvent, stream_key

log = logging.getLogger("kvpool.batch")

URLS = {"/v1/completions": False, "/v1/chat/completions": True}
"""The endpoints a batch line may name, and whether each is chat."""

CHECK_EVERY_S = 2.0
POLL_BLOCK_MS = 500


# -- input -------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One non-blank input line, as read."""

    number: int
    raw: str


@dataclass(frozen=True)
class Parsed:
    """A line with the fields a batch request needs; its body is not checked yet."""

    line: Line
    custom_id: str
    chat: bool
    body: dict[str, Any]


@dataclass(frozen=True)
class Rejected:
    """A line that can never become a job: answered with an error result and reported by its line number.

    With ``api_error`` the result carries an HTTP-style response (as the API would have
    answered the body); without, an ``error`` object with ``code`` and ``message``.
    """

    line: int
    result_id: str
    custom_id: str | None
    code: str
    message: str
    api_error: APIError | None = None

    def report(self) -> str:
        return f"line {self.line}: {self.message}"

    def record(self) -> dict[str, Any]:
        if self.api_error is not None:
            body = self.api_error.body()
            body["error"]["message"] = self.report()
            return result_record(self.result_id, self.custom_id, response={"status_code": self.api_error.status, "request_id": None, "body": body})
        return result_record(self.result_id, self.custom_id, error={"code": self.code, "message": self.report()})


def read_lines(path: Path) -> list[Line]:
    """The non-blank lines of the input, numbered from 1 as an editor shows them."""
    with open(path, "rb") as f:
        return [Line(n, raw.decode("utf-8", "replace").strip()) for n, raw in enumerate(f, start=1) if raw.strip()]


def request_result_id(custom_id: str) -> str:
    """Derived from the custom_id, so a rerun recognises the request's result in the output."""
    return "batch_req_" + hashlib.sha256(b"custom_id\0" + custom_id.encode()).hexdigest()[:32]


def line_result_id(line: Line) -> str:
    """For lines without a usable custom_id: derived from the line's number and text."""
    return "batch_req_" + hashlib.sha256(f"line\0{line.number}\0{line.raw}".encode()).hexdigest()[:32]


def parse_line(line: Line) -> Parsed | Rejected:
    """Check a line's structure (JSON object, custom_id, method, url, body object); the body's contents come later."""

    def bad(code: str, message: str, custom_id: str | None = None) -> Rejected:
        return Rejected(line.number, line_result_id(line), custom_id, code, message)

    try:
        doc = json.loads(line.raw)
    except json.JSONDecodeError as e:
        return bad("invalid_json", f"invalid JSON: {e.msg} (column {e.colno})")
    if not isinstance(doc, dict):
        return bad("invalid_json", f"expected a JSON object, got {type(doc).__name__}")
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return bad("missing_custom_id", "custom_id is missing or not a non-empty string")
    missing = [k for k in ("method", "url", "body") if k not in doc]
    if missing:
        return bad("missing_field", f"missing field(s): {', '.join(missing)}", custom_id)
    if not isinstance(doc["method"], str) or doc["method"].upper() != "POST":
        return bad("invalid_method", f"method must be POST, got {doc['method']!r}", custom_id)
    if doc["url"] not in URLS:
        return bad("invalid_url", f"url must be one of {', '.join(URLS)}, got {doc['url']!r}", custom_id)
    if not isinstance(doc["body"], dict):
        return bad("invalid_body", "body must be a JSON object", custom_id)
    return Parsed(line, custom_id, URLS[doc["url"]], doc["body"])


def parse_all(lines: Iterable[Line]) -> list[Parsed | Rejected]:
    """Parse every line; a custom_id seen on an earlier line makes a later one a duplicate.

    A duplicate's error result has no custom_id, so that whoever maps results by custom_id
    finds the answer to the first line, not the complaint about the second.
    """
    seen: dict[str, int] = {}
    out: list[Parsed | Rejected] = []
    for line in lines:
        p = parse_line(line)
        if isinstance(p, Parsed):
            first = seen.setdefault(p.custom_id, line.number)
            if first != line.number:
                p = Rejected(line.number, line_result_id(line), None, "duplicate_custom_id", f"duplicate custom_id {p.custom_id!r} (first on line {first})")
        out.append(p)
    return out


def result_id_of(entry: Parsed | Rejected) -> str:
    return request_result_id(entry.custom_id) if isinstance(entry, Parsed) else entry.result_id


def _validation_error(e: ValidationError) -> InvalidRequest:
    err = e.errors()[0] if e.errors() else {}
    loc = [str(p) for p in err.get("loc", [])]
    where = ".".join(loc)
    msg = err.get("msg", "invalid request")
    return InvalidRequest(f"body.{where}: {msg}" if where else f"body: {msg}", param=loc[0] if loc else None)


# -- requests and their schedule ---------------------------------------------------------


@dataclass
class Request:
    """A line that became a job spec, with the reuse its place in the schedule allows."""

    line: int
    custom_id: str
    prepared: Prepared
    want_logprobs: bool
    ideal: int = 0

    @property
    def result_id(self) -> str:
        return request_result_id(self.custom_id)

    @property
    def chain(self) -> list[str]:
        return self.prepared.spec.chain


def prepare(parsed: Parsed, preparer: Preparer, tenant: Tenant) -> Request | Rejected:
    """Validate the body and build its job, as the API would; failures keep the API's status and error body."""
    try:
        if parsed.chat:
            chat = ChatCompletionRequest.model_validate(parsed.body)
            return Request(parsed.line.number, parsed.custom_id, preparer.chat(chat, tenant), chat.logprobs)
        comp = CompletionRequest.model_validate(parsed.body)
        return Request(parsed.line.number, parsed.custom_id, preparer.completion(comp, tenant), comp.logprobs is not None)
    except ValidationError as e:
        err: APIError = _validation_error(e)
    except APIError as e:
        err = e
    except Exception as e:
        log.exception("batch.prepare_failed", extra={"line": parsed.line.number})
        err = APIError(f"internal error: {type(e).__name__}", code="internal_error")
    return Rejected(parsed.line.number, request_result_id(parsed.custom_id), parsed.custom_id, err.code or "invalid_body", err.message, err)


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.count = 0


def _insert(root: _Node, chain: list[str]) -> int:
    """Add ``chain`` to the trie; returns how many of its leading keys were already there."""
    node, depth, known = root, 0, True
    for key in chain:
        child = node.children.get(key)
        if child is None:
            child = node.children[key] = _Node()
            known = False
        elif known:
            depth += 1
        child.count += 1
        node = child
    return depth


def _sharing(root: _Node, chain: list[str]) -> int:
    """Sum over the other chains in the trie of the full chunks each shares with ``chain``."""
    node, total = root, 0
    for key in chain:
        node = node.children[key]
        total += node.count - 1
    return total


@dataclass
class Group:
    """Requests sharing at least their first chunk; the leader runs first, its siblings after it."""

    leader: Request | None
    siblings: deque[Request] = field(default_factory=deque)
    leader_job: str | None = None
    leader_done: bool = False

    @property
    def leader_running(self) -> bool:
        return self.leader_job is not None and not self.leader_done


def plan(requests: list[Request], chunk_size: int) -> list[Group]:
    """Group by first chain key, pick each group's leader, and set every request's ideal reuse.

    The leader is the member sharing the most full chunks with the others (a trie over
    the chain keys counts them in one pass), so its published chunks cover as much of
    the group's shared prefix as any member's would. Requests without a full chunk, or
    sharing none, are groups of one.
    """
    trie = _Node()
    for r in requests:
        _insert(trie, r.chain)
    slots: list[Request | list[Request]] = []
    shared: dict[str, list[Request]] = {}
    for r in requests:
        if not r.chain or trie.children[r.chain[0]].count == 1:
            slots.append(r)
        elif r.chain[0] in shared:
            shared[r.chain[0]].append(r)
        else:
            shared[r.chain[0]] = [r]
            slots.append(shared[r.chain[0]])
    return [Group(leader=s) if isinstance(s, Request) else _lead(s, trie, chunk_size) for s in slots]


def _lead(members: list[Request], trie: _Node, chunk_size: int) -> Group:
    """The group in schedule order (leader, then siblings by line); each ideal counts what runs before it."""
    leader = max(members, key=lambda r: _sharing(trie, r.chain))
    group = Group(leader=leader, siblings=deque(r for r in members if r is not leader))
    scheduled = _Node()
    for r in [leader, *group.siblings]:
        r.ideal = min(_insert(scheduled, r.chain) * chunk_size, len(r.prepared.spec.tokens) - 1)
    return group


# -- output ------------------------------------------------------------------------------


def result_record(result_id: str, custom_id: str | None, *, response: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": result_id, "custom_id": custom_id, "response": response, "error": error}


class ResultFile:
    """The output file: read what an earlier run answered, then append one durable line per result."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: set[str] = set()
        self._f: BinaryIO | None = None

    def load(self) -> ResultFile:
        """Collect the ids already answered; a last line cut short by a kill is dropped (its request runs again)."""
        if not self.path.exists():
            return self
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning("output.partial_line_dropped", extra={"path": str(self.path), "bytes": len(data) - end})
            with open(self.path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        for n, raw in enumerate(data[:end].splitlines(), start=1):
            try:
                self.done.add(json.loads(raw)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                log.warning("output.unreadable_line", extra={"path": str(self.path), "line": n})
        return self

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "ab")  # noqa: SIM115 -- held open for the whole run, closed by close()
        self._f.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done.add(record["id"])

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


# -- the tally ---------------------------------------------------------------------------


@dataclass
class Tally:
    """What this run did, for the progress bar and the summary."""

    lines: int = 0
    already_done: int = 0
    answered: int = 0
    failed: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_from_context: int = 0
    cached_from_store: int = 0
    evaluated_tokens: int = 0
    completion_tokens: int = 0
    ideal_tokens: int = 0
    ideal_reused: int = 0
    started: float = field(default_factory=time.monotonic)

    def add(self, request: Request, result: JobResult) -> None:
        u = result.usage
        self.answered += 1
        self.prompt_tokens += u.prompt_tokens
        self.cached_tokens += u.cached_tokens
        self.cached_from_context += u.cached_from_context
        self.cached_from_store += u.cached_from_store
        self.evaluated_tokens += u.evaluated_tokens
        self.completion_tokens += u.completion_tokens
        self.ideal_tokens += request.ideal
        self.ideal_reused += min(u.cached_tokens, request.ideal)

    @property
    def hit_ratio(self) -> float:
        """Reused prompt tokens over all prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ideal_ratio(self) -> float:
        """The hit ratio whole-chunk sharing allows."""
        return self.ideal_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def of_ideal(self) -> float:
        """Reuse achieved over reuse allowed, each request counted up to its own ideal (token-level reuse
        from a worker's context can exceed whole chunks, and must not hide a missed chunk elsewhere)."""
        return self.ideal_reused / self.ideal_tokens if self.ideal_tokens else 1.0

    def finished(self) -> int:
        return self.already_done + self.answered + self.failed + self.rejected

    def summary(self) -> list[str]:
        elapsed = time.monotonic() - self.started
        done = self.answered + self.failed
        return [
            (
                f"requests: {self.lines} lines, {self.answered} answered, {self.failed} failed, {self.rejected} rejected, "
                f"{self.already_done} already done, in {elapsed:.1f} s ({done / elapsed if elapsed > 0 else 0.0:.1f} requests/s)"
            ),
            (
                f"tokens: {self.prompt_tokens:,} prompt = {self.evaluated_tokens:,} evaluated + {self.cached_tokens:,} reused "
                f"({self.cached_from_context:,} from a worker's context, {self.cached_from_store:,} from the store); "
                f"{self.completion_tokens:,} generated"
            ),
            f"hit ratio: {self.hit_ratio:.1%} of prompt tokens reused; whole-chunk sharing allows {self.ideal_ratio:.1%}",
            f"reuse: {self.ideal_reused:,} of {self.ideal_tokens:,} tokens that whole-chunk sharing allows "
            + (f"({self.of_ideal:.1%})" if self.ideal_tokens else "(no full chunk shared)"),
        ]


# -- running -----------------------------------------------------------------------------


class BatchAborted(Exception):
    """The batch cannot go on (no worker, no progress); what is answered stays answered, a rerun resumes."""


@dataclass
class Flight:
    """A submitted job not yet answered."""

    request: Request
    group: Group
    leader: bool
    job_id: str
    last: str = "0"
    tokens: list[TokenEvent] = field(default_factory=list)


class Runner:
    """Submits the groups' jobs within a bounded window and turns their events into result lines.

    One thread reads the streams of every job in flight with a single XREAD. Every few
    seconds it also asks RQ about those jobs (one that failed or vanished without a final
    event) and checks that some worker is still alive.
    """

    def __init__(
        self,
        conn: redis.Redis,
        settings: GatewaySettings,
        model_name: str,
        groups: list[Group],
        out: ResultFile,
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
                self._on_event(flight, parse_event(fields))

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
        build = chat_body if r.prepared.chat else completion_body
        body = build(flight.job_id, self.model_name, result, flight.tokens, r.want_logprobs)
        self.out.write(result_record(r.result_id, r.custom_id, response={"status_code": 200, "request_id": flight.job_id, "body": body}))
        self.tally.add(r, result)
        del self.flights[flight.job_id]
        if flight.leader:
            flight.group.leader_done = True
            if flight.group.siblings:
                self._ready.append(flight.group)
        log.debug(
            "batch.answered",
            extra={"job": flight.job_id, "line": r.line, "leader": flight.leader, "cached": result.usage.cached_tokens, "ideal": r.ideal, "worker": result.worker},
        )
        self.on_change()

    def _failed(self, flight: Flight, error: APIError) -> None:
        r = flight.request
        self.out.write(result_record(r.result_id, r.custom_id, response={"status_code": error.status, "request_id": flight.job_id, "body": error.body()}))
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
            job = Job.fetch_many([f.job_id], connection=self.conn)[0]
            if job is not None:
                job.delete()
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
            raise BatchAborted(f"no live worker for {self.worker_grace_s:.0f} s; start workers with `kvpool worker` and rerun the same command to resume")
        if self.flights and now - self._progress_at > self.settings.request_timeout_s:
            raise BatchAborted(
                f"no progress for {self.settings.request_timeout_s:.0f} s with {len(self.flights)} jobs in flight; "
                f"are the workers serving queue {self.settings.queue!r}? Rerun the same command to resume"
            )

    def _check_jobs(self) -> None:
        """Settle jobs RQ says are over but whose final event never came (failed before writing one, or expired)."""
        ids = list(self.flights)
        if not ids:
            return
        pipe = self.conn.pipeline(transaction=False)
        for j in ids:
            pipe.hget(Job.key_for(j), "status")
        for job_id, raw in zip(ids, pipe.execute()):
            status = raw.decode() if isinstance(raw, bytes) else raw
            if status not in (None, JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
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
            self._failed(flight, WorkerFailed(f"the job ended ({status or 'gone from the queue'}) without an answer", code="worker_error"))


def _return_value(conn: redis.Redis, job_id: str) -> JobResult | None:
    job = Job.fetch_many([job_id], connection=conn)[0]
    value = job.return_value() if job is not None else None
    try:
        return JobResult.model_validate(value)
    except ValidationError:
        return None


# -- progress ----------------------------------------------------------------------------


class RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:.1f} req/s" if speed else "-- req/s", style="progress.data.speed")


def progress_bar(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[hit]}"),
        console=console,
        disable=not enabled,
        speed_estimate_period=60.0,
    )


def hit_text(tally: Tally) -> str:
    return f"store hit {tally.hit_ratio:.0%} (ideal {tally.ideal_ratio:.0%})"


# -- the command -------------------------------------------------------------------------


def resolve_tenant(settings: GatewaySettings, tenant_id: str | None) -> Tenant:
    """Whose cache the batch uses: ``--tenant``, or the default tenant when the pool has no API keys."""
    tenants = Tenants(settings.api_keys, settings.tenant_secret)
    known = set(settings.api_keys.values())
    if tenant_id is None:
        if known:
            raise click.ClickException("KVPOOL_API_KEYS is set: name the tenant whose cache this batch uses with --tenant")
        return tenants.resolve(None)
    if known and tenant_id not in known:
        raise click.ClickException(f"unknown tenant {tenant_id!r}; KVPOOL_API_KEYS names: {', '.join(sorted(known))}")
    if not known and tenant_id != DEFAULT_TENANT:
        log.warning("batch.tenant_unconfigured", extra={"tenant": tenant_id, "reason": "no KVPOOL_API_KEYS: the gateway serves only 'default'"})
    return Tenant(tenant_id, tenants.salt(tenant_id))


def _require_workers(conn: redis.Redis) -> int:
    try:
        n = len(adverts(conn))
    except redis.RedisError as e:
        raise click.ClickException(f"the job queue (Redis, KVPOOL_REDIS_URL) is unreachable: {type(e).__name__}: {e}") from None
    if not n:
        raise click.ClickException("no live worker is serving this pool (KVPOOL_REDIS_URL); start one with `kvpool worker`, then rerun")
    return n


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.status = 128 + signum


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise _Interrupted(signum)


def run_batch(
    settings: GatewaySettings,
    input_path: Path,
    output_path: Path,
    *,
    tenant: Tenant,
    window: int,
    worker_grace_s: float,
    show_progress: bool,
) -> int:
    """Run the batch; returns the exit status (0 once every line has its result line)."""
    entries = parse_all(read_lines(input_path))
    out = ResultFile(output_path).load()
    tally = Tally(lines=len(entries))
    todo = [e for e in entries if result_id_of(e) not in out.done]
    tally.already_done = len(entries) - len(todo)
    log.info("batch.start", extra={"input": str(input_path), "output": str(output_path), "lines": len(entries), "already_done": tally.already_done})
    status = 0
    if todo:
        conn = redis.Redis.from_url(
            settings.redis_url, socket_connect_timeout=settings.connect_timeout_s, socket_timeout=settings.read_timeout_s + POLL_BLOCK_MS / 1000
        )
        if any(isinstance(e, Parsed) for e in todo):
            log.info("batch.workers", extra={"workers": _require_workers(conn), "window": window})
        previous = signal.signal(signal.SIGTERM, _on_signal)
        try:
            status = _run(settings, conn, todo, out, tally, tenant=tenant, window=window, worker_grace_s=worker_grace_s, show_progress=show_progress)
        finally:
            signal.signal(signal.SIGTERM, previous)
            out.close()
    click.echo("\n".join(tally.summary()))
    log.info(
        "batch.done",
        extra={
            "status": status,
            "answered": tally.answered,
            "failed": tally.failed,
            "rejected": tally.rejected,
            "prompt_tokens": tally.prompt_tokens,
            "cached_tokens": tally.cached_tokens,
            "ideal_tokens": tally.ideal_tokens,
            "of_ideal": round(tally.of_ideal, 4),
        },
    )
    return status


def _run(
    settings: GatewaySettings,
    conn: redis.Redis,
    todo: list[Parsed | Rejected],
    out: ResultFile,
    tally: Tally,
    *,
    tenant: Tenant,
    window: int,
    worker_grace_s: float,
    show_progress: bool,
) -> int:
    """Prepare the lines still to do, answer the rejected ones, plan and run the rest under a progress bar."""
    from worker.process import resolve_model

    try:
        preparer = Preparer(settings, resolve_model(settings))
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    console = Console(stderr=True)
    runner: Runner | None = None
    with progress_bar(console, show_progress) as bar:
        task = bar.add_task("batch", total=tally.lines, completed=tally.already_done, hit=hit_text(tally))

        def changed() -> None:
            bar.update(task, completed=tally.finished(), hit=hit_text(tally))

        try:
            requests: list[Request] = []
            for entry in todo:
                item = prepare(entry, preparer, tenant) if isinstance(entry, Parsed) else entry
                if isinstance(item, Request):
                    requests.append(item)
                    continue
                console.print(Text.assemble(("rejected ", "yellow"), item.report()), highlight=False)
                out.write(item.record())
                tally.rejected += 1
                changed()
            groups = plan(requests, settings.chunk_size)
            log.info("batch.planned", extra={"requests": len(requests), "groups": len(groups), "ideal_tokens": sum(r.ideal for r in requests)})
            runner = Runner(conn, settings, preparer.model_name, groups, out, tally, window=window, worker_grace_s=worker_grace_s, on_change=changed)
            runner.run()
        except (KeyboardInterrupt, _Interrupted) as e:
            if runner is not None:
                runner.cancel_all()
            console.print("interrupted; rerun the same command to resume", highlight=False)
            return e.status if isinstance(e, _Interrupted) else 130
        except BatchAborted as e:
            if runner is not None:
                runner.cancel_all()
            console.print(Text.assemble(("error: ", "red"), str(e)), highlight=False)
            return 1
        except redis.RedisError as e:
            console.print(Text.assemble(("error: ", "red"), f"the job queue (Redis) is unreachable: {type(e).__name__}: {e}; rerun the same command to resume"), highlight=False)
            return 1
    return 0


@click.command("batch")
@click.argument("input_path", metavar="REQUESTS.jsonl", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", "output_path", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Results (JSONL), appended as requests finish.")
@click.option("--tenant", default=None, help="Tenant whose cache the batch uses (required when KVPOOL_API_KEYS is set).")
@click.option("--max-in-flight", type=click.IntRange(min=1), default=None, help="Jobs submitted and not yet answered (default: half of KVPOOL_MAX_WAITING_JOBS).")
@click.option("--worker-grace", type=click.FloatRange(min=0), default=30.0, show_default=True, help="Seconds without any live worker before giving up.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar on stderr.")
def batch_command(input_path: Path, output_path: Path, tenant: str | None, max_in_flight: int | None, worker_grace: float, progress: bool) -> None:
    """Answer a file of OpenAI batch requests over the worker pool, sharing each common prefix once.

    Results go to OUTPUT as they finish. Interrupted? Rerun the same command: the lines
    OUTPUT already answers are skipped. Settings come from KVPOOL_* variables.
    """
    try:
        settings = GatewaySettings()
    except ValidationError as e:
        raise click.ClickException(f"bad settings: {e}") from None
    window = max_in_flight or max(1, settings.max_waiting_jobs // 2)
    status = run_batch(
        settings,
        input_path,
        output_path,
        tenant=resolve_tenant(settings, tenant),
        window=window,
        worker_grace_s=worker_grace,
        show_progress=progress,
    )
    raise SystemExit(status)


if __name__ == "__main__":
    from store.logs import configure_logging

    configure_logging(os.environ.get("KVPOOL_LOG_LEVEL", "INFO"), os.environ.get("KVPOOL_LOG_JSON", "").lower() in ("1", "true", "yes"))
    batch_command()
