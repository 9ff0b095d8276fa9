"""A job's event stream: what the worker writes to Redis, and when."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import redis
import redis.asyncio

from gateway.streams import StreamReader
from tests.helpers import in_one_round, poll
from tests.redis_faults import ReplyLosingProxy
from worker.client import Event, entry_events, events, take_events
from worker.engine.context import Context
from worker.engine.rounds import Request
from worker.process.jobstream import Emitter, JobStream
from worker.protocol import DoneEvent, JobResult, Once, StartEvent, Timings, TokenEvent, Usage, cancel_key, entry, stream_key
from worker.settings import WorkerSettings


def _result() -> JobResult:
    return JobResult(
        text="abc",
        finish_reason="stop",
        tokens=[1, 2, 3],
        usage=Usage(prompt_tokens=1, completion_tokens=3, cached_tokens=0, cached_from_context=0, cached_from_store=0, evaluated_tokens=1),
        timings=Timings(),
        worker="w",
    )


def _events(conn: redis.Redis, job_id: str) -> list[Event]:
    """Every event the stream holds, repeats included (each entry holds the events of one write)."""
    return [e for _, fields in conn.xrange(stream_key(job_id)) for e in entry_events(fields)]


def _written(conn: redis.Redis, job_id: str) -> int:
    return len(_events(conn, job_id))


def _texts(conn: redis.Redis, job_id: str) -> list[str]:
    return [e.text if isinstance(e, TokenEvent) else "" for e in _events(conn, job_id)]


def test_with_no_interval_every_token_is_written_as_soon_as_it_is_sent(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    stream = JobStream(conn, "now", ttl_s=60, interval_s=0.0)
    for i, tok in enumerate("abc"):
        assert stream.send(TokenEvent(text=tok, token=i))
        poll(lambda n=i + 1: _written(conn, "now") == n, f"token {i} in the stream")
    stream.close()
    assert _texts(conn, "now") == ["a", "b", "c"]


def test_sending_a_token_never_waits_for_redis(redis_url: str) -> None:
    """The decoding thread hands its tokens to the stream's writer: they are sent while Redis accepts no write at all."""
    conn, admin = redis.Redis.from_url(redis_url), redis.Redis.from_url(redis_url)
    stream = JobStream(conn, "paused", ttl_s=60, interval_s=0.0)
    assert stream.send(StartEvent(attempt=1, worker="w"))
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        for i in range(5):
            assert stream.send(TokenEvent(text=str(i), token=i))
        assert _written(conn, "paused") == 1, "the tokens were sent, and none is written while writes are paused"
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    assert stream.send(DoneEvent(result=_result())), "the last event returns once it, and every token before it, is in Redis"
    stream.close()
    got = list(events(conn, "paused", timeout_s=5))
    assert [type(e).__name__ for e in got] == ["StartEvent"] + ["TokenEvent"] * 5 + ["DoneEvent"]
    assert [e.text for e in got if isinstance(e, TokenEvent)] == ["0", "1", "2", "3", "4"], "each token once, in order"


def test_tokens_within_the_interval_wait_for_the_next_event_due_and_keep_their_order(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    stream = JobStream(conn, "held", ttl_s=60, interval_s=3600.0)
    assert stream.send(StartEvent(attempt=1, worker="w"))
    assert stream.send(TokenEvent(text="a", token=1))
    poll(lambda: _written(conn, "held") == 2, "the first token (never held)")
    assert stream.send(TokenEvent(text="b", token=2))
    assert stream.send(TokenEvent(text="c", token=3))
    assert _written(conn, "held") == 2, "b and c wait for the next event due"
    assert stream.send(DoneEvent(result=_result()))
    stream.close()
    got = list(events(conn, "held", timeout_s=5))
    assert [type(e).__name__ for e in got] == ["StartEvent", "TokenEvent", "TokenEvent", "TokenEvent", "DoneEvent"]
    assert "".join(e.text for e in got if isinstance(e, TokenEvent)) == "abc"
    assert 0 < conn.ttl(stream_key("held")) <= 60


def test_the_tokens_held_between_two_writes_go_out_in_one_entry(redis_url: str) -> None:
    """One XADD per stream and write, whatever it carries: Redis and the gateway's reader handle an entry a write, not a token."""
    conn = redis.Redis.from_url(redis_url)
    stream = JobStream(conn, "together", ttl_s=60, interval_s=3600.0)
    assert stream.send(StartEvent(attempt=1, worker="w"))
    assert stream.send(TokenEvent(text="a", token=1))
    poll(lambda: _written(conn, "together") == 2, "the first token (never held)")
    for i, tok in enumerate("bcd"):
        assert stream.send(TokenEvent(text=tok, token=i + 2))
    assert stream.send(DoneEvent(result=_result()))
    stream.close()
    entries = conn.xrange(stream_key("together"))
    assert [len(entry_events(fields)) for _, fields in entries] == [1, 1, 4], "start; a; b, c, d and the answer in one entry"
    assert [int(fields[b"n"]) for _, fields in entries] == [1, 2, 6], "each entry numbered by its last event"
    assert [e.text for e in events(conn, "together", timeout_s=5) if isinstance(e, TokenEvent)] == ["a", "b", "c", "d"]


def test_a_reader_takes_only_the_events_it_has_not_seen_from_an_entry_that_repeats_some() -> None:
    """A write that failed for good leaves its events to the next, which may hold them beside newer ones: each is read once."""
    once, writer = Once(), b"w1"

    def fields(first: int, last: int) -> dict[bytes, bytes]:
        lines = [TokenEvent(text=str(n), token=n).model_dump_json() for n in range(first, last + 1)]
        return {k.encode(): str(v).encode() for k, v in entry(lines, writer.decode(), last).items()}

    def texts(f: dict[bytes, bytes]) -> list[str]:
        return [e.text for e in take_events(once, f) if isinstance(e, TokenEvent)]

    assert texts(fields(1, 2)) == ["1", "2"]
    assert texts(fields(3, 5)) == ["3", "4", "5"], "Redis ran this write; its reply was lost"
    assert texts(fields(3, 5)) == [], "the same write retried"
    assert texts(fields(3, 8)) == ["6", "7", "8"], "its events again, with the newer ones"


def test_a_token_is_written_once_the_interval_has_passed(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    stream = JobStream(conn, "due", ttl_s=60, interval_s=0.3)
    for i, tok in enumerate("abc"):
        stream.send(TokenEvent(text=tok, token=i))
    poll(lambda: _written(conn, "due") == 3, "the held tokens, once the interval has passed, with no later event")
    stream.close()
    assert _texts(conn, "due") == ["a", "b", "c"]


def test_a_cancel_is_seen_at_the_next_write(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    stream = JobStream(conn, "gone", ttl_s=60, interval_s=0.0)
    assert stream.send(TokenEvent(text="a", token=1))
    poll(lambda: _written(conn, "gone") == 1, "the first token")
    conn.set(cancel_key("gone"), 1)
    stream.send(TokenEvent(text="b", token=2))
    poll(lambda: not stream.send(TokenEvent(text="c", token=3)), "the writer to report the cancel")
    stream.close()


def test_closing_waits_for_the_write_in_flight_so_nothing_of_the_attempt_lands_after_it(redis_url: str) -> None:
    """A retried attempt's tokens are counted from its start event: a late write of the ended attempt would count as its."""
    conn, admin = redis.Redis.from_url(redis_url), redis.Redis.from_url(redis_url)
    stream = JobStream(conn, "ended", ttl_s=60, interval_s=0.0)
    admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    closer = threading.Thread(target=stream.close)
    try:
        assert stream.send(TokenEvent(text="a", token=1))
        poll(lambda: stream._writing.locked(), "the writer to start writing the token (Redis holds it)")
        closer.start()
        closer.join(1.0)
        assert closer.is_alive(), "close returned while the token's write was still waiting for Redis"
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    closer.join(30)
    assert not closer.is_alive()
    assert _texts(conn, "ended") == ["a"], "the write in flight landed before close returned"


async def _atexts(conn: redis.asyncio.Redis, job_id: str) -> list[str]:
    reader = StreamReader(conn)  # the gateway's reader of job streams
    try:
        return [e.text async for batch in reader.batches(job_id) for e in batch or [] if isinstance(e, TokenEvent)]
    finally:
        await reader.close()


def test_a_write_redis_ran_but_never_answered_is_retried_and_read_once(redis_url: str) -> None:
    """Redis went away after it ran a write and before it replied: the retry repeats its entries, and readers count each event once."""
    admin = redis.Redis.from_url(redis_url)
    with ReplyLosingProxy(urlsplit(redis_url).port or 6379) as proxy:
        conn = redis.Redis(host="127.0.0.1", port=proxy.port)
        stream = JobStream(conn, "unanswered", ttl_s=60, interval_s=0.0)
        assert stream.send(StartEvent(attempt=1, worker="w"))
        assert stream.send(TokenEvent(text="a", token=1))
        poll(lambda: _written(admin, "unanswered") == 2, "the first token")
        proxy.pipelines, proxy.only_with = True, b"XADD"
        proxy.armed.set()
        assert stream.send(TokenEvent(text="b", token=2))
        poll(proxy.lost.is_set, "the write of b to run without its reply reaching the worker")
        assert stream.send(DoneEvent(result=_result()))
        stream.close()
    assert _texts(admin, "unanswered") == ["", "a", "b", "b", ""], "Redis holds the retried write twice"
    got = list(events(admin, "unanswered", timeout_s=5))
    assert [type(e).__name__ for e in got] == ["StartEvent", "TokenEvent", "TokenEvent", "DoneEvent"]
    assert [e.text for e in got if isinstance(e, TokenEvent)] == ["a", "b"]
    assert asyncio.run(_atexts(redis.asyncio.Redis.from_url(redis_url), "unanswered")) == ["a", "b"], "the gateway's reader too"


def test_an_emitter_whose_thread_dies_is_reported_and_the_next_token_gets_a_new_one(redis_url: str) -> None:
    """The emitter is supervised as the engine loop is: a death stops the worker (`worker.process.supervision`), never silently."""
    conn = redis.Redis.from_url(redis_url)
    died: list[tuple[str, BaseException]] = []
    emitter = Emitter.shared()
    real_write, real_hook = Emitter._write, Emitter.on_death

    def broken(self: Emitter, streams: list[JobStream]) -> None:
        raise RuntimeError("a bug in the emitter")

    Emitter.on_death = lambda name, error: died.append((name, error))
    Emitter._write = broken  # type: ignore[method-assign]
    try:
        stream = JobStream(conn, "emitter-dies", ttl_s=60)
        stream.send(TokenEvent(text="a", token=1))
        poll(lambda: not emitter.thread.is_alive(), "the emitter's thread ended")
        assert [(name, str(error)) for name, error in died] == [("kvpool-emitter", "a bug in the emitter")]
    finally:
        Emitter._write, Emitter.on_death = real_write, real_hook  # type: ignore[method-assign]
    stream.send(TokenEvent(text="b", token=2))
    assert Emitter.shared() is not emitter and Emitter.shared().thread.is_alive(), "a new emitter for the tokens that follow"
    poll(lambda: _texts(conn, "emitter-dies") == ["a", "b"], "both tokens written, in order, by the new emitter")


def test_the_tokens_of_one_round_go_out_in_one_write_whichever_connection_each_job_came_with(redis_url: str, tiny_model: Path) -> None:
    """Each RQ thread has its own Redis connection; the emitter writes the round's step of every job in one pipeline, once the round's last token is sent."""
    context = Context(WorkerSettings(model=str(tiny_model), parallel=2, n_ctx=256, n_threads=1), tiny_model)
    loop, emitter, rounds = context.loop, Emitter.shared(), 6
    streams = [JobStream(redis.Redis.from_url(redis_url), f"round-{seq}", ttl_s=60, interval_s=0.0) for seq in (0, 1)]
    steps, last_round, before = {0: 0, 1: 0}, [-1], emitter.writes
    try:
        for seq, stream in enumerate(streams):
            stream.send(StartEvent(attempt=1, worker="w"))
            loop.decode(seq, [5, 6, 7, 8], 0)

        def advance(req: Request) -> tuple[list[int], int] | None:
            steps[req.seq] += 1
            streams[req.seq].send(TokenEvent(text=f"{req.seq}.{steps[req.seq]}", token=steps[req.seq]))
            if loop.rounds != last_round[0]:  # the round's first token: the emitter is given 50 ms to write it alone, and must not
                last_round[0], written, until = loop.rounds, emitter.writes, time.monotonic() + 0.05
                while emitter.writes == written and time.monotonic() < until:
                    time.sleep(0.005)
            return ([1], req.pos + 1) if steps[req.seq] < rounds else None

        in_one_round(loop, lambda: loop.generate(0, [1], 4, advance), lambda: loop.generate(1, [1], 4, advance))
        tokens = [[f"{seq}.{n}" for n in range(1, rounds + 1)] for seq in (0, 1)]
        poll(
            lambda: [_texts(s.conn, f"round-{seq}")[1:] for seq, s in enumerate(streams)] == tokens,
            "every token in its stream, once, in order, written by the emitter (none waits for the job's next event)",
        )
        for stream in streams:
            stream.send(DoneEvent(result=_result()))
            stream.close()
    finally:
        context.close()
    assert emitter.writes - before <= rounds, f"{emitter.writes - before} writes for {rounds} rounds of two jobs: one a round"
