"""Two live attempts of one job write to its stream: readers follow the latest attempt and never join one's tokens to the other's.

RQ retries a job whose heartbeat lapsed (a Redis pause of several seconds, a heartbeat thread
that died) while its first attempt may still run: both then write to the job's stream. Real
Redis; the events are written by two `worker.process.jobstream.JobStream` writers, as two attempts write them.
"""

from __future__ import annotations

import asyncio
import time

import redis
import redis.asyncio
from starlette.requests import Request

from gateway.relay import RelayContext, relay, relay_reads
from gateway.streams import StreamReader
from tests.helpers import poll
from worker.client import events
from worker.process.jobstream import JobStream
from worker.protocol import DoneEvent, JobResult, StartEvent, Timings, TokenEvent, Usage, stream_key

JOB = "two-attempts"


def _result(n: int) -> JobResult:
    usage = Usage(prompt_tokens=1, completion_tokens=n, cached_tokens=0, cached_from_context=0, cached_from_store=0, evaluated_tokens=1)
    return JobResult(text="", finish_reason="length", tokens=list(range(n)), usage=usage, timings=Timings(), worker="w2")


def _write_interleaved(conn: redis.Redis) -> None:
    """start w1, a1..a5, start w2, b1, a6 (from w1), b2..b7, done (w2): each entry in Redis before the next is sent."""
    first, second = JobStream(conn, JOB, ttl_s=60), JobStream(conn, JOB, ttl_s=60)
    order = [(first, StartEvent(attempt=1, worker="w1"))]
    order += [(first, TokenEvent(text=f"a{i}", token=i)) for i in range(1, 6)]
    order += [
        (second, StartEvent(attempt=2, worker="w2")),
        (second, TokenEvent(text="b1", token=1)),
        (first, TokenEvent(text="a6", token=6)),
    ]
    order += [(second, TokenEvent(text=f"b{i}", token=i)) for i in range(2, 8)]
    order += [(second, DoneEvent(result=_result(7)))]
    for n, (stream, event) in enumerate(order, start=1):
        stream.send(event)
        poll(lambda n=n: conn.xlen(stream_key(JOB)) == n, f"entry {n} in the stream")
    first.close()
    second.close()


def test_a_reader_drops_the_entries_of_an_attempt_once_a_later_one_started(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    _write_interleaved(conn)
    got = list(events(conn, JOB, timeout_s=5))
    assert [e.worker for e in got if isinstance(e, StartEvent)] == ["w1", "w2"]
    after_second = got[[i for i, e in enumerate(got) if isinstance(e, StartEvent)][-1] :]
    assert [e.text for e in after_second if isinstance(e, TokenEvent)] == [f"b{i}" for i in range(1, 8)], "a6 is the first attempt's"
    assert isinstance(got[-1], DoneEvent)


def test_the_relay_gives_the_client_each_position_once_from_the_attempt_that_finished(redis_url: str) -> None:
    """The client had a1..a5 from the first attempt; from the second it gets b6 and b7, never a6 counted as the second's."""
    _write_interleaved(redis.Redis.from_url(redis_url))

    async def run() -> list[str]:
        ctx = _context(redis.asyncio.Redis.from_url(redis_url), JOB)
        try:
            return [ev.text async for ev in relay(ctx) if isinstance(ev, TokenEvent)]
        finally:
            await ctx.reader.close()

    assert asyncio.run(run()) == ["a1", "a2", "a3", "a4", "a5", "b6", "b7"]


def test_a_streamed_response_gets_the_new_tokens_of_one_read_together(redis_url: str) -> None:
    """`relay_reads` hands over what one read of the stream brought in one piece, so the response writes it to the socket once."""
    conn = redis.Redis.from_url(redis_url)
    stream = JobStream(conn, "one-read", ttl_s=60, interval_s=3600.0)
    stream.send(StartEvent(attempt=1, worker="w"))
    stream.send(TokenEvent(text="t0", token=0))
    poll(lambda: conn.xlen(stream_key("one-read")) == 2, "the first token, written at once")
    for i in range(1, 4):
        stream.send(TokenEvent(text=f"t{i}", token=i))
    stream.send(DoneEvent(result=_result(4)))
    stream.close()
    assert conn.xlen(stream_key("one-read")) == 3, "start; the first token at once; three held tokens with the answer"

    async def run() -> list[object]:
        ctx = _context(redis.asyncio.Redis.from_url(redis_url), "one-read")
        try:
            return [r if isinstance(r, JobResult) else [t.text for t in r] async for r in relay_reads(ctx)]
        finally:
            await ctx.reader.close()

    got = asyncio.run(run())
    assert got[0] == ["t0", "t1", "t2", "t3"], "the whole stream was there at the first read"
    assert isinstance(got[1], JobResult) and len(got) == 2


def _context(aredis: redis.asyncio.Redis, job_id: str) -> RelayContext:
    async def receive() -> dict[str, object]:
        await asyncio.sleep(3600)  # the client stays
        return {"type": "http.disconnect"}

    async def alive() -> bool:
        return True

    async def nothing() -> None:
        return None

    return RelayContext(
        request=Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive),
        aredis=aredis,
        reader=StreamReader(aredis),
        job_id=job_id,
        queue="kvpool",
        t0=time.perf_counter(),
        timeout_s=60,
        endpoint="completions",
        any_worker_alive=alive,
        resubmit=nothing,
        job_seconds=lambda s: None,
    )
