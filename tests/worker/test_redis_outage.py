"""A Redis restart is ridden out, not turned into an error: the retry policy, a job's event stream written and read across one."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from gateway.pool.procs import RedisServer
from gateway.streams import StreamReader
from worker.client import entry_events
from worker.process.jobstream import JobStream
from worker.protocol import ErrorEvent, StartEvent, TokenEvent, stream_key
from worker.redis_retry import outage_retry, ride_out


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, to stop and start again on the same port."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def seen_down() -> Iterator[threading.Event]:
    """Set once the code under test logs that it found Redis unreachable (``redis.unavailable``)."""
    event = threading.Event()

    class Note(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == "redis.unavailable":
                event.set()

    handler, logger = Note(), logging.getLogger("kvpool.redis")
    logger.addHandler(handler)
    yield event
    logger.removeHandler(handler)


def _restart_once(server: RedisServer, tmp_path: Path, seen_down: threading.Event) -> RedisServer:
    """Start ``server`` again on its port once the code under test has found it down."""
    assert seen_down.wait(30), "the code under test never tried Redis while it was down"
    return RedisServer(tmp_path / "redis", port=server.port).start()


def _client(server: RedisServer) -> redis.Redis:
    """A client without redis-py's own retries (ten, by default, on every command), so that only the policy under test waits."""
    return redis.Redis(port=server.port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_the_waits_double_from_the_first_up_to_the_cap_and_fit_in_the_outage() -> None:
    retry = outage_retry(10.0, first_s=0.1, cap_s=1.0)
    waits = [retry._backoff.compute(n) for n in range(1, retry.get_retries() + 1)]
    assert waits[:5] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0])
    assert set(waits[4:]) == {1.0}
    assert sum(waits) <= 10.0 < sum(waits) + 1.0, "as many retries as fit in the outage"
    assert outage_retry(0.0).get_retries() == 0, "no budget: one try"


def test_a_call_is_retried_until_redis_is_back(own_redis: RedisServer, tmp_path: Path, seen_down: threading.Event) -> None:
    conn = _client(own_redis)
    tries = [0]

    def ping() -> bool:
        tries[0] += 1
        return bool(conn.ping())

    own_redis.stop()
    t, out = _in_thread(lambda: ride_out(ping, 30.0, what="test"))
    server = _restart_once(own_redis, tmp_path, seen_down)
    try:
        t.join(30)
        assert out == {"value": True} and tries[0] >= 2
    finally:
        server.stop()


def test_an_outage_longer_than_the_budget_raises_the_last_error(own_redis: RedisServer) -> None:
    conn = _client(own_redis)
    own_redis.stop()
    with pytest.raises(redis.ConnectionError):
        ride_out(conn.ping, 0.3, what="test")


def test_an_error_that_is_no_outage_is_raised_at_once(own_redis: RedisServer) -> None:
    conn = redis.Redis(port=own_redis.port)
    conn.set("a-string", "x")
    tries = [0]

    def wrong_type() -> Any:
        tries[0] += 1
        return conn.lpush("a-string", "y")

    with pytest.raises(redis.ResponseError):
        ride_out(wrong_type, 30.0, what="test")
    assert tries[0] == 1


def test_a_job_stream_written_while_redis_restarts_loses_no_event(
    own_redis: RedisServer, tmp_path: Path, seen_down: threading.Event
) -> None:
    conn = _client(own_redis)
    stream = JobStream(conn, "across", ttl_s=60)
    assert stream.send(StartEvent(attempt=1, worker="w"))
    own_redis.stop()
    last = ErrorEvent(error="the end", retrying=False)
    t, out = _in_thread(lambda: stream.send(TokenEvent(text="a", token=1), outage_s=30.0) and stream.send(last, outage_s=30.0))
    server = _restart_once(own_redis, tmp_path, seen_down)
    try:
        t.join(30)
        assert out == {"value": True}, "the last event returned once it was written"
        written = [e for _, fields in conn.xrange(stream_key("across")) for e in entry_events(fields)]
        assert [getattr(e, "text", getattr(e, "error", None)) for e in written] == ["a", "the end"], (
            "written once Redis was back, in order (a Redis without AOF lost the start)"
        )
        stream.close()
    finally:
        server.stop()


def test_reading_a_job_stream_resumes_after_a_redis_restart(own_redis: RedisServer, tmp_path: Path) -> None:
    """Redis stops mid-stream and comes back: the reader yields ``None`` meanwhile, then the events written since."""
    writer = JobStream(_client(own_redis), "read-across", ttl_s=60)
    writer.send(StartEvent(attempt=1, worker="w"))
    servers = [own_redis]

    async def read() -> list[Any]:
        aconn = redis.asyncio.Redis(port=own_redis.port, socket_connect_timeout=1, retry=AsyncRetry(NoBackoff(), 0))
        got: list[Any] = []
        reader = StreamReader(aconn, block_ms=200)  # the gateway's reader of job streams
        async for batch in reader.batches("read-across"):
            got.extend(batch or [None])
            if batch is None and len(servers) == 1:
                servers.append(await asyncio.to_thread(RedisServer(tmp_path / "redis", port=own_redis.port).start))
                await asyncio.to_thread(writer.send, TokenEvent(text="b", token=2))
            elif any(isinstance(ev, StartEvent) for ev in batch or []):
                await asyncio.to_thread(own_redis.stop)
            if any(isinstance(ev, TokenEvent) for ev in batch or []):
                break
        await reader.close()
        await aconn.aclose()
        return got

    try:
        got = asyncio.run(read())
    finally:
        servers[-1].stop()
    assert [type(e).__name__ for e in got] == ["StartEvent", "NoneType", "TokenEvent"]
