"""A job's event stream: what the worker writes to Redis, and when."""

from __future__ import annotations

import redis

from worker.client import events
from worker.jobs import JobStream
from worker.protocol import DoneEvent, JobResult, StartEvent, Timings, TokenEvent, Usage, cancel_key, stream_key


def _result() -> JobResult:
    return JobResult(
        text="abc",
        finish_reason="stop",
        tokens=[1, 2, 3],
        usage=Usage(prompt_tokens=1, completion_tokens=3, cached_tokens=0, cached_from_context=0, cached_from_store=0, evaluated_tokens=1),
        timings=Timings(),
        worker="w",
    )


def _written(conn: redis.Redis, job_id: str) -> int:
    return int(conn.xlen(stream_key(job_id)))


def test_with_no_interval_every_event_is_written_at_once(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    stream = JobStream(conn, "now", ttl_s=60, interval_s=0.0)
    for i, tok in enumerate("abc"):
        assert stream.send(TokenEvent(text=tok, token=i))
        assert _written(conn, "now") == i + 1


def test_tokens_within_the_interval_wait_for_the_next_event_due_and_keep_their_order(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    stream = JobStream(conn, "held", ttl_s=60, interval_s=3600.0)
    assert stream.send(StartEvent(attempt=1, worker="w"))
    assert stream.send(TokenEvent(text="a", token=1))
    assert _written(conn, "held") == 2, "the first token is never held"
    assert stream.send(TokenEvent(text="b", token=2))
    assert stream.send(TokenEvent(text="c", token=3))
    assert _written(conn, "held") == 2
    assert stream.send(DoneEvent(result=_result()))
    got = list(events(conn, "held", timeout_s=5))
    assert [type(e).__name__ for e in got] == ["StartEvent", "TokenEvent", "TokenEvent", "TokenEvent", "DoneEvent"]
    assert "".join(e.text for e in got if isinstance(e, TokenEvent)) == "abc"
    assert 0 < conn.ttl(stream_key("held")) <= 60


def test_a_token_is_written_once_the_interval_has_passed(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    stream = JobStream(conn, "due", ttl_s=60, interval_s=3600.0)
    stream.send(TokenEvent(text="a", token=1))
    stream.send(TokenEvent(text="b", token=2))
    assert _written(conn, "due") == 1
    stream.interval_s = 0.0
    stream.send(TokenEvent(text="c", token=3))
    assert _written(conn, "due") == 3


def test_a_cancel_is_seen_at_the_next_write(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    stream = JobStream(conn, "gone", ttl_s=60, interval_s=3600.0)
    assert stream.send(TokenEvent(text="a", token=1))
    conn.set(cancel_key("gone"), 1)
    assert stream.send(TokenEvent(text="b", token=2)), "a held token reports what the last write saw"
    assert not stream.flush()
    assert not stream.send(TokenEvent(text="c", token=3))
