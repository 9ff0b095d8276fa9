"""A gateway reads every job stream it relays with one blocking read at a time (`gateway.streams.StreamReader`).

Real Redis; the events are written as a worker writes them (`worker.process.jobstream.JobStream`).
"""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio

from gateway.streams import StreamReader
from worker.process.jobstream import Emitter, JobStream
from worker.protocol import DoneEvent, JobResult, StartEvent, Timings, TokenEvent, Usage


def _done(n: int) -> DoneEvent:
    usage = Usage(prompt_tokens=1, completion_tokens=n, cached_tokens=0, cached_from_context=0, cached_from_store=0, evaluated_tokens=1)
    return DoneEvent(result=JobResult(text="", finish_reason="length", tokens=list(range(n)), usage=usage, timings=Timings(), worker="w"))


async def _collect(reader: StreamReader, job: str) -> list[str]:
    return [e.text async for batch in reader.batches(job) for e in batch or [] if isinstance(e, TokenEvent)]


def test_four_streams_answered_together_are_written_together_and_read_by_one_read_and_each_gets_all_of_its_own(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url)
    jobs = [f"together-{i}" for i in range(4)]
    streams = [JobStream(conn, job, ttl_s=60, interval_s=0.02) for job in jobs]  # as workers write (KVPOOL_STREAM_INTERVAL_MS)
    rounds = 20

    async def run() -> tuple[list[list[str]], int]:
        reader = StreamReader(redis.asyncio.Redis.from_url(redis_url), block_ms=1000)
        readers = [asyncio.create_task(_collect(reader, job)) for job in jobs]
        await asyncio.sleep(0)  # every request subscribed, as four clients that came in together
        for s in streams:
            s.send(StartEvent(attempt=1, worker="w"))
        for r in range(rounds):  # one round: a token for every sequence, as the engine loop steps them together
            for i, s in enumerate(streams):
                s.send(TokenEvent(text=f"{i}.{r}", token=r))
            await asyncio.sleep(0.03)
        for s in streams:
            s.send(_done(rounds))
        got = await asyncio.wait_for(asyncio.gather(*readers), 30)
        await reader.close()
        return got, reader.reads

    writes = Emitter.shared().writes
    got, reads = asyncio.run(run())
    writes = Emitter.shared().writes - writes
    for s in streams:
        s.close()
    print(f"{rounds} rounds of four streams: {writes} writes, {reads} reads")
    assert got == [[f"{i}.{r}" for r in range(rounds)] for i in range(4)], "each request got its own tokens, each once, in order"
    assert writes <= rounds + 2, f"{writes} token writes for {rounds} rounds: one write carries every stream's step"
    # A blocked XREAD is answered with the one stream that woke it on Redis before 7.2 (Debian 12 has 7.0), and the next
    # read, at once, with the rest: two reads a round whatever the number of streams, where a read per stream took four.
    assert reads <= 2 * rounds + 10, f"{reads} reads for {rounds} rounds: one reader serves every stream"


def test_a_request_that_subscribes_while_the_read_is_blocked_is_read_at_once(redis_url: str) -> None:
    """The reader blocks for up to a minute on the first stream; the second request's answer still comes at once."""
    conn = redis.Redis.from_url(redis_url)

    async def run() -> list[str]:
        reader = StreamReader(redis.asyncio.Redis.from_url(redis_url), block_ms=60_000)
        quiet = asyncio.create_task(_collect(reader, "quiet"))
        await asyncio.sleep(0.2)  # the read is in flight, blocked on the quiet stream alone
        late = JobStream(conn, "late", ttl_s=60)
        late.send(StartEvent(attempt=1, worker="w"))
        late.send(TokenEvent(text="hello", token=1))
        late.send(_done(1))
        late.close()
        try:
            return await asyncio.wait_for(_collect(reader, "late"), 10)
        finally:
            quiet.cancel()
            await reader.close()

    assert asyncio.run(run()) == ["hello"]


def test_a_quiet_stream_yields_none_each_block_so_the_relay_can_check_its_client_and_deadline(redis_url: str) -> None:
    async def run() -> int:
        reader = StreamReader(redis.asyncio.Redis.from_url(redis_url), block_ms=100)
        ticks = 0
        async for batch in reader.batches("silent"):
            assert batch is None
            ticks += 1
            if ticks == 3:
                break
        await reader.close()
        return ticks

    assert asyncio.run(run()) == 3
