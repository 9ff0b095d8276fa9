"""Riding out a Redis restart: redis-py's `Retry` with `ExponentialBackoff`, sized to an outage budget.

A Redis that restarts refuses connections for about a second. A call that must not fail
for that (enqueueing a request, writing a job's events) is retried on
``ConnectionError``/``TimeoutError`` with a backoff that starts at ``first_s``, doubles
and stops growing at ``cap_s``, for as many retries as fit in ``outage_s``; past that, or
past ``outage_s`` of wall-clock time (a call that times out takes a while itself), the
last error is raised. Any other error is raised at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

log = logging.getLogger("kvpool.redis")

T = TypeVar("T")

RETRIED = (redis.ConnectionError, redis.TimeoutError)
"""What a restarting Redis raises; anything else is not an outage."""


def backoff(first_s: float = 0.1, cap_s: float = 1.0) -> ExponentialBackoff:
    """Waits of ``first_s``, ``2 * first_s``, ... at most ``cap_s`` (redis-py's ``compute(failures)`` counts from 1)."""
    return ExponentialBackoff(cap=cap_s, base=first_s / 2)


def retries_within(outage_s: float, waits: ExponentialBackoff) -> int:
    """How many retries' waits add up to at most ``outage_s``."""
    retries, waited = 0, 0.0
    while waited + waits.compute(retries + 1) <= outage_s:
        retries += 1
        waited += waits.compute(retries)
    return retries


def outage_retry(outage_s: float, *, first_s: float = 0.1, cap_s: float = 1.0) -> Retry:
    """A `Retry` whose waits add up to at most ``outage_s``."""
    waits = backoff(first_s, cap_s)
    return Retry(waits, retries_within(outage_s, waits), supported_errors=RETRIED)


def ride_out(
    call: Callable[[], T],
    outage_s: float,
    *,
    what: str,
    first_s: float = 0.1,
    cap_s: float = 1.0,
    give_up: Callable[[], bool] = lambda: False,
) -> T:
    """Run ``call``, retried while Redis is unreachable for up to ``outage_s`` (or until ``give_up()``); logs each failure as ``redis.unavailable``."""
    deadline = time.monotonic() + outage_s

    def failed(e: Exception) -> None:
        if time.monotonic() >= deadline or give_up():
            raise e
        log.warning("redis.unavailable", extra={"during": what, "reason": f"{type(e).__name__}: {e}"})

    return outage_retry(outage_s, first_s=first_s, cap_s=cap_s).call_with_retry(call, failed)


async def aride_out(call: Callable[[], Awaitable[T]], outage_s: float, *, what: str, first_s: float = 0.1, cap_s: float = 1.0) -> T:
    """`ride_out` for redis-py's asyncio client: ``call`` makes a fresh awaitable on each try."""
    deadline = time.monotonic() + outage_s
    waits = backoff(first_s, cap_s)

    async def failed(e: Exception) -> None:
        if time.monotonic() >= deadline:
            raise e
        log.warning("redis.unavailable", extra={"during": what, "reason": f"{type(e).__name__}: {e}"})

    retry = AsyncRetry(waits, retries_within(outage_s, waits), supported_errors=RETRIED)
    return await retry.call_with_retry(call, failed)
