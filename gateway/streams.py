"""One reader of job streams per gateway process: a single blocking XREAD over every stream a request relays.

Each request used to read its own job's stream: at four streaming
clients, four blocking reads woke the gateway and Redis for every batch a worker wrote.
`StreamReader` keeps one read in flight for all of them, as vLLM's front end takes one
message per engine step for every request: ``XREAD BLOCK`` over every subscribed stream,
each from the last entry its subscriber was given, and each reply's entries handed to the
subscribers whose streams they came from. A request that subscribes while the read is
blocked cancels that read (redis-py drops its connection), so the next read includes its
stream at once; nothing is lost, since a stream is read again from the last entry given.

`StreamReader.batches` gives a subscriber its job's events, those of one read together (each once,
only the latest attempt's: `worker.client.take_events`), ``None`` after every ``block_ms``
in which nothing came (the relay's checks run then), and ``None`` while Redis is away,
reading resuming where it stopped once Redis is back. Token events, the bulk of a stream,
are built without validation (`worker.client.parse_event`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio

from worker.client import READ_BACKOFF_CAP_S, Event, final_event, take_events
from worker.protocol import Once, stream_key
from worker.redis_retry import RETRIED, backoff

log = logging.getLogger("kvpool.gateway")


@dataclass(eq=False)
class _Subscriber:
    key: bytes
    last: bytes = b"0"
    once: Once = field(default_factory=Once)
    inbox: asyncio.Queue[list[dict[bytes, bytes]] | None] = field(default_factory=asyncio.Queue)


class StreamReader:
    """The gateway's one reader of job streams (see the module's doc); started with the first subscriber, on its event loop."""

    def __init__(self, aredis: redis.asyncio.Redis[bytes], block_ms: int = 1000) -> None:
        self.aredis = aredis
        self.block_ms = block_ms
        self._subs: dict[bytes, list[_Subscriber]] = {}
        self._task: asyncio.Task[None] | None = None
        self._read: asyncio.Task[Any] | None = None
        self._changed = asyncio.Event()
        self._closing = False
        self.reads = 0
        """XREAD calls made (for tests and the A/B of the token path)."""

    async def batches(self, job_id: str) -> AsyncGenerator[list[Event] | None]:
        """The job's events from its stream's start until a final one, a list per read; ``None`` whenever ``block_ms`` passed without one."""
        sub = self._subscribe(stream_key(job_id).encode())
        try:
            while True:
                try:
                    async with asyncio.timeout(self.block_ms / 1000):
                        batch = await sub.inbox.get()
                except TimeoutError:
                    batch = None
                if batch is None:
                    yield None
                    continue
                events = [e for fields in batch for e in take_events(sub.once, fields)]
                end = next((i for i, e in enumerate(events) if final_event(e)), None)
                if end is not None:
                    yield events[: end + 1]
                    return
                if events:
                    yield events
        finally:
            self._unsubscribe(sub)

    async def close(self) -> None:
        self._closing = True
        self._changed.set()
        if self._task is not None:
            self._task.cancel()  # redis-py may end a cancelled read normally: the loop also stops at ``_closing``
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _subscribe(self, key: bytes) -> _Subscriber:
        sub = _Subscriber(key)
        self._subs.setdefault(key, []).append(sub)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvpool-stream-reader")
        elif self._read is not None and not self._read.done():
            self._read.cancel()  # blocked without this stream: read again with it
        self._changed.set()
        return sub

    def _unsubscribe(self, sub: _Subscriber) -> None:
        subs = self._subs.get(sub.key, [])
        if sub in subs:
            subs.remove(sub)
        if not subs:
            self._subs.pop(sub.key, None)

    async def _run(self) -> None:
        """Read until closed: one XREAD of every subscribed stream at a time, from the least advanced subscriber of each."""
        waits, failures = backoff(cap_s=READ_BACKOFF_CAP_S), 0
        while not self._closing:
            if not self._subs:
                self._changed.clear()
                await self._changed.wait()
                continue
            streams = {key: min(s.last for s in subs) for key, subs in self._subs.items()}
            self._read = asyncio.ensure_future(self._xread(streams))
            try:
                reply = await self._read
            except asyncio.CancelledError:
                if self._read.cancelled() and not _cancelling():
                    continue  # a new subscriber: read again, with its stream
                raise
            except RETRIED:
                failures += 1
                for subs in list(self._subs.values()):
                    for s in subs:
                        s.inbox.put_nowait(None)
                await asyncio.sleep(waits.compute(failures))
                continue
            self.reads += 1
            failures = 0
            self._hand_out(reply or [])

    async def _xread(self, streams: dict[bytes, bytes]) -> Any:
        """The read, made when its task starts: one cancelled before it starts (a subscriber came) leaves no command unawaited."""
        return await self.aredis.xread(streams, count=256, block=self.block_ms)

    def _hand_out(self, reply: list[Any]) -> None:
        for key, entries in reply:
            for s in self._subs.get(key, []):
                fresh = [(i, f) for i, f in entries if _after(i, s.last)]
                if fresh:
                    s.last = fresh[-1][0]
                    s.inbox.put_nowait([f for _, f in fresh])


def _cancelling() -> bool:
    """Whether the task running this (the reader) is itself being cancelled, not only the read it awaited."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _after(entry_id: bytes, last: bytes) -> bool:
    """Whether stream entry ``entry_id`` comes after ``last`` (ids are ``ms-seq``)."""
    a, _, b = entry_id.partition(b"-")
    c, _, d = last.partition(b"-")
    return (int(a), int(b or 0)) > (int(c), int(d or 0))
