"""A job's Redis stream, as the worker writes it: one `JobStream` per attempt, one `Emitter` per process.

A job's events (start, its tokens, done or error) go to its stream
(`worker.protocol.stream_key`), which the gateway reads (`gateway.streams`). Token events
leave the decoding thread at once and reach Redis through the process's one emitter thread,
which writes the held tokens of every job together: one pipeline per Redis server and loop
round (`worker.engine.loop.after_round`), one stream entry per job with all its tokens
(`worker.protocol.entry`), then one MGET of every client's cancel. Every other event is
written by the job's own thread, after every token sent before it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from pydantic import BaseModel

from worker.engine.loop import after_round
from worker.protocol import TokenEvent, cancel_key, entry, stream_key
from worker.redis_retry import ride_out

log = logging.getLogger("kvpool.worker.jobstream")

STREAM_MAXLEN = 4096
STREAM_BACKOFF_CAP_S = 0.5
"""The longest wait between two tries at writing events while Redis is away: the tokens wait for it once Redis is back."""

WATCH_S = 0.1
"""How often a job in its prompt asks Redis whether its client cancelled (`JobStream.watch`)."""

STOPPING = threading.Event()
"""Set when the worker process is asked to stop: a job's stream no longer waits for an unreachable Redis (nothing it writes could be read)."""


class JobStream:
    """Writes a job's events to its Redis stream; every write also reports whether the client cancelled.

    Token events are written by the process's one `Emitter`, so the thread that decodes
    never waits for Redis: the emitter writes every stream's held tokens together, in one
    pipeline, at most once per ``interval_s`` (a stream's first token at once), so the
    tokens of every sequence's step reach Redis, and wake the gateway's one reader
    (`gateway.streams`), together. Every other event (start, done, error) is written by the
    caller, after every token sent before it, and `send` returns once it is in Redis: a
    job's outcome is in its stream before RQ hears of it. A token write that fails for
    good (Redis away longer than the outage allows) fails the next `send`. Whether the
    client cancelled is what the latest write found; `close` ends the stream's writes.
    The stream's expiry is renewed by those events, and by a token write only once half of
    ``ttl_s`` has passed since the last renewal, not by every write.

    Each entry names its writer (this stream, one per attempt) and its place among the
    writer's entries: a write retried after Redis applied it but lost its reply (a Redis
    shut down between the two) repeats entries, and readers drop the repeats by those
    (`worker.protocol.Once`).
    """

    def __init__(self, conn: redis.Redis, job_id: str, ttl_s: int, interval_s: float = 0.0) -> None:
        self.conn = conn
        self.server = _server(conn)
        """The Redis server the stream is on: the emitter writes the streams of one server in one pipeline."""
        self.key = stream_key(job_id)
        self.cancel = cancel_key(job_id)
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.writer = uuid.uuid4().hex[:12]
        self._sent = 0
        self._held: list[tuple[int, str]] = []
        self._wake = threading.Lock()
        """Guards ``_held`` (the decoding thread adds, the emitter and `send` take)."""
        self._writing = threading.Lock()
        """Held while events leave ``_held`` and are written: they reach Redis in the order sent."""
        self._closed = False
        self._failed: Exception | None = None
        self._cancelled = False
        self._watched_at = float("-inf")
        self.outage_s = 10.0
        self.written_at = float("-inf")
        """When the emitter last wrote this stream's tokens (never: the first is due at once)."""
        self.renewed_at = float("-inf")
        """When the stream's expiry was last set."""

    def send(self, event: BaseModel, outage_s: float = 10.0) -> bool:
        """Append ``event`` (a token through the emitter, anything else at once); False once cancelled.

        Rides out a Redis restart of up to ``outage_s`` seconds (`worker.redis_retry`).
        """
        line = event.model_dump_json(exclude_none=True)
        if isinstance(event, TokenEvent):
            if self._failed is not None:
                raise self._failed
            with self._wake:
                self._hold(line)
                self.outage_s = outage_s
            Emitter.shared().wake(self)
            return not self._cancelled
        with self._writing:
            with self._wake:
                self._hold(line)
            return self._write(outage_s)

    def watch(self) -> str | None:
        """Whether the client cancelled (or left), asked by the engine loop between prompt pieces; Redis read at most every ``WATCH_S``."""
        now = time.monotonic()
        if not self._cancelled and now - self._watched_at >= WATCH_S:
            self._watched_at = now
            try:
                self._cancelled = bool(self.conn.exists(self.cancel))
            except redis.RedisError:
                pass  # Redis away: the job goes on, and its next write rides the outage out
        return "cancelled by the client" if self._cancelled else None

    def _hold(self, line: str) -> None:
        """Queue ``line`` as the writer's next entry; the caller holds ``_wake``."""
        self._sent += 1
        self._held.append((self._sent, line))

    def take(self) -> list[tuple[int, str]]:
        """The held events, for a write (the caller holds ``_writing``); none once closed."""
        with self._wake:
            lines, self._held = ([], []) if self._closed else (self._held, [])
        return lines

    def put_back(self, lines: list[tuple[int, str]], error: Exception | None = None) -> None:
        """Events a write did not get into Redis: they go out with the next write, in order (with ``error``: that write fails)."""
        with self._wake:
            self._held[:0] = lines
            if error is not None:
                self._failed = error

    def close(self) -> None:
        """End the stream's writes; once this returns, nothing of this attempt reaches the stream.

        A write in flight (riding out a Redis restart) finishes first: were it to land after
        a retried attempt's start, its tokens would count as the new attempt's. Tokens still
        held were written by the last event, or are of a cancelled or failed attempt.
        """
        with self._wake:
            self._closed = True
        with self._writing, self._wake:
            self._held.clear()

    def _write(self, outage_s: float) -> bool:
        """Write every held event in one entry and renew the stream's expiry, in one round trip; the caller holds ``_writing``."""
        with self._wake:
            lines, self._held = self._held, []
        if not lines:
            return not self._cancelled

        def write() -> list[Any]:
            pipe = self.conn.pipeline(transaction=False)  # a retry after Redis applied it repeats the entry: readers drop it (`Once`)
            pipe.xadd(self.key, entry([e for _, e in lines], self.writer, lines[-1][0]), maxlen=STREAM_MAXLEN, approximate=True)
            pipe.expire(self.key, self.ttl_s)
            pipe.exists(self.cancel)
            return pipe.execute()

        try:
            done = ride_out(write, outage_s, what="job_stream", cap_s=STREAM_BACKOFF_CAP_S, give_up=STOPPING.is_set)
        except Exception:
            self.put_back(lines)  # not written: they go out with the next write (the job's error), in order
            raise
        self.renewed_at = time.monotonic()
        self._cancelled = bool(done[-1])
        return not self._cancelled

    def saw_cancel(self, cancelled: bool) -> None:
        self._cancelled = self._cancelled or cancelled


class Emitter:
    """The one thread of a worker process that writes every job stream's held tokens, together (see `JobStream`).

    When the first stream with held tokens is due (its ``interval_s`` after its last write,
    or at once for its first token), every stream holding tokens is written, in one
    pipeline per Redis server (each RQ thread has its own connection; the streams of all of them share the write): one entry per stream with all its tokens, then one MGET
    of every client's cancel, so one round trip carries the step of every sequence and reads
    every cancel.
    A stream whose own event is being written by its job (`JobStream.send`) is skipped: that
    write takes its tokens too.
    """

    _shared: Emitter | None = None
    _lock = threading.Lock()
    on_death: Callable[[str, BaseException], None] | None = None
    """Told when an emitter's thread dies (`worker.process.supervision`): the worker process stops, as when any of its threads dies."""

    @classmethod
    def shared(cls) -> Emitter:
        """The process's emitter (a forked child gets one of its own: its parent's thread is not in it; so does a process whose emitter died)."""
        with cls._lock:
            if cls._shared is None or cls._shared.pid != os.getpid() or not cls._shared.thread.is_alive():
                cls._shared = Emitter()
            return cls._shared

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._cv = threading.Condition()
        self._dirty: set[JobStream] = set()
        self._in_round: set[JobStream] = set()
        """Streams given tokens by the round the engine loop is advancing: held until its last token is sent."""
        self._until = -math.inf
        """When the waiting emitter wakes next (inf: when told; -inf: it is not waiting)."""
        self.writes = 0
        """Pipelines written (for tests and the A/B of the token path)."""
        self.thread = threading.Thread(target=self._supervised, name="kvpool-emitter", daemon=True)
        self.thread.start()

    def wake(self, stream: JobStream) -> None:
        """``stream`` holds tokens: the emitter wakes only if it is due before the emitter would wake anyway (not once a token).

        A token the engine loop sends as it advances a round counts once the round's last
        token is sent (`worker.engine.loop.after_round`): one write carries every sequence's step.
        """
        if after_round(self._round_sent):
            with self._cv:
                self._in_round.add(stream)
            return
        self._mark_dirty([stream])

    def _round_sent(self) -> None:
        with self._cv:
            streams, self._in_round = list(self._in_round), set()
        self._mark_dirty(streams)

    def _mark_dirty(self, streams: list[JobStream]) -> None:
        with self._cv:
            self._dirty.update(streams)
            if any(s.written_at + s.interval_s < self._until for s in streams):
                self._cv.notify()

    def _supervised(self) -> None:
        try:
            self._run()
        except BaseException as e:  # never silent: the tokens of every job would wait for its next event
            log.exception("emitter.died")
            if Emitter.on_death is not None:
                Emitter.on_death("kvpool-emitter", e)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._dirty or (due := min(s.written_at + s.interval_s for s in self._dirty)) > time.monotonic():
                    self._until = math.inf if not self._dirty else due
                    self._cv.wait(None if not self._dirty else max(0.0, due - time.monotonic()))
                self._until = -math.inf  # writing: a stream that holds tokens meanwhile is seen when it is done
                batch, self._dirty = self._dirty, set()
            by_server: dict[tuple[object, ...], list[JobStream]] = {}
            for s in batch:
                by_server.setdefault(s.server, []).append(s)
            for streams in by_server.values():
                self._write(streams)

    def _write(self, streams: list[JobStream]) -> None:
        """One pipeline of these streams' held tokens and cancel checks (one Redis server); each stream's lock held throughout."""
        taken: list[tuple[JobStream, list[tuple[int, str]]]] = []
        for s in streams:
            if not s._writing.acquire(blocking=False):
                continue  # its job is writing an event: that write takes the tokens held
            lines = s.take()
            if lines:
                taken.append((s, lines))
            else:
                s._writing.release()
        if not taken:
            return
        conn, now = taken[0][0].conn, time.monotonic()
        renew = {s for s, _ in taken if now - s.renewed_at > s.ttl_s / 2}

        def write() -> list[Any]:
            pipe = conn.pipeline(transaction=False)  # a retry of what Redis ran repeats entries: readers drop them (`Once`)
            for s, lines in taken:
                pipe.xadd(s.key, entry([e for _, e in lines], s.writer, lines[-1][0]), maxlen=STREAM_MAXLEN, approximate=True)
                if s in renew:
                    pipe.expire(s.key, s.ttl_s)
            pipe.mget([s.cancel for s, _ in taken])
            return pipe.execute()

        try:
            outage_s = max(s.outage_s for s, _ in taken)
            done = ride_out(write, outage_s, what="job_stream", cap_s=STREAM_BACKOFF_CAP_S, give_up=STOPPING.is_set)
        except Exception as e:  # Redis away for good: each job's next send raises it
            for s, lines in taken:
                s.put_back(lines, e)
        else:
            self.writes += 1
            for (s, _), cancelled in zip(taken, done[-1], strict=True):
                s.saw_cancel(cancelled is not None)
                if s in renew:
                    s.renewed_at = now
        finally:
            now = time.monotonic()
            for s, _ in taken:
                s.written_at = now
                s._writing.release()


def _server(conn: redis.Redis) -> tuple[object, ...]:
    """The Redis server ``conn`` reaches: the streams of every job on it share a pipeline, whichever RQ thread's connection they came with."""
    kw = conn.connection_pool.connection_kwargs
    return kw.get("host"), kw.get("port"), kw.get("path"), kw.get("db", 0), kw.get("username")
