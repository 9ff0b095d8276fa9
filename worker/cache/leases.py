"""Coalescing: a new prefix is evaluated once in the pool, however many workers get it at once.

A worker about to evaluate full chunks the store does not hold takes a short *lease* on
each (`worker.protocol.lease_key`), renews it while it works, and releases it once the
publisher has stored those chunks, or when the job fails. Claiming is one atomic script
over all the prompt's chunks: each is either leased to the caller or reported with its
holder, so two workers that start the same prompt at the same moment never split it. A
worker whose prompt needs chunks another worker holds waits for them instead of
evaluating them too: it polls the leases, and when they are gone (released after the
publish) it looks the prompt up in the store again and restores what was published.

Nothing can hang on a lease:

* a holder that dies or stalls stops renewing, so its leases expire within ``lease_s``;
* a waiter never waits longer than evaluating the leased tokens itself would take, by
  its own recent rate (`EvalRate`), so a slow holder costs it nothing but the check;
* Redis errors end the wait at once: the waiter evaluates on its own.

Leases are advisory. Two workers that race past each other both evaluate and publish,
and the store counts the chunk once; the lease only saves the work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import redis

from worker.errors import JobAborted
from worker.protocol import lease_key

log = logging.getLogger("kvpool.worker.leases")

POLL_S = 0.02
"""How often a waiter looks at the leases it waits for."""

# Lease each key nobody holds; return the holder of every key (the caller's name where it got the lease).
_CLAIM = """
local out = {}
for i = 1, #KEYS do
  if redis.call('SET', KEYS[i], ARGV[1], 'NX', 'PX', ARGV[2]) then
    out[i] = ARGV[1]
  else
    out[i] = redis.call('GET', KEYS[i]) or ''
  end
end
return out
"""

# Renew or release only what is still ours: a lease that expired may belong to another worker now.
_RENEW = """
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
end
return 1
"""
_RELEASE = """
local n = 0
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then n = n + redis.call('DEL', KEYS[i]) end
end
return n
"""


class LeaseOutcome(StrEnum):
    """How a wait for other workers' leases ended: the ``outcome`` label of ``kvpool_worker_lease_waits_total``."""

    RELEASED = "released"
    """Every lease is gone: the holder published (or gave up); look the prompt up again."""
    TIMEOUT = "timeout"
    """Waited as long as evaluating the tokens would take: evaluate them."""
    ERROR = "error"
    """Redis failed: evaluate at once."""


@dataclass
class Claim:
    """The leases one job took; released once, by the publisher or by the job's end."""

    keys: list[str] = field(default_factory=list)
    released: bool = False


class EvalRate:
    """Exponentially weighted prompt-evaluation rate of this worker, tokens per second."""

    def __init__(self, weight: float = 0.3) -> None:
        self.weight = weight
        self.tokens_per_s: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 32 or seconds <= 0:
            return
        rate = tokens / seconds
        self.tokens_per_s = rate if self.tokens_per_s is None else (1 - self.weight) * self.tokens_per_s + self.weight * rate

    def seconds_for(self, tokens: int, default_s: float) -> float:
        return default_s if self.tokens_per_s is None else tokens / self.tokens_per_s


class Leases:
    """This worker's leases in one Redis, renewed by one background thread."""

    def __init__(self, conn: redis.Redis, owner: str, lease_s: float, min_wait_s: float = 0.0) -> None:
        self.conn = conn
        self.owner = owner
        self.lease_ms = max(1, int(lease_s * 1000))
        self.min_wait_s = min_wait_s
        self._claims: list[Claim] = []
        self._lock = threading.Lock()
        self._claim = conn.register_script(_CLAIM)
        self._renew = conn.register_script(_RENEW)
        self._release = conn.register_script(_RELEASE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="kvpool-leases", daemon=True)
        self._thread.start()

    def claim(self, keys: Sequence[bytes]) -> tuple[Claim, list[str | None]]:
        """Lease every chunk key nobody holds, atomically; returns the claim and each key's holder (None: unknown).

        Raises ``redis.RedisError``: then nothing was leased.
        """
        claim = Claim()
        if not keys:
            return claim, []
        names = [lease_key(k) for k in keys]
        got = [h.decode() or None for h in self._claim(keys=names, args=[self.owner, self.lease_ms])]
        claim.keys = [n for n, h in zip(names, got) if h == self.owner]
        with self._lock:
            self._claims.append(claim)
        return claim, got

    def release(self, claim: Claim) -> None:
        with self._lock:
            if claim.released:
                return
            claim.released = True
            self._claims = [c for c in self._claims if c is not claim]
        if claim.keys:
            try:
                self._release(keys=claim.keys, args=[self.owner])
            except redis.RedisError as e:
                log.warning("lease.release_failed", extra={"reason": str(e), "leases": len(claim.keys)})

    def wait(self, keys: Sequence[bytes], max_wait_s: float, watch: Callable[[], str | None] | None = None) -> LeaseOutcome:
        """Wait until none of ``keys`` is leased any more, or until ``max_wait_s`` have passed, or Redis fails.

        Raises `JobAborted` as soon as ``watch`` (the job's, `worker.process.jobstream.JobStream.watch`) says the job should stop.
        """
        names = [lease_key(k) for k in keys]
        deadline = time.monotonic() + max_wait_s
        while True:
            if watch is not None and (why := watch()) is not None:
                raise JobAborted(why)
            try:
                if not self.conn.exists(*names):
                    return LeaseOutcome.RELEASED
            except redis.RedisError:
                return LeaseOutcome.ERROR
            if time.monotonic() >= deadline:
                return LeaseOutcome.TIMEOUT
            time.sleep(POLL_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self._lock:
            claims = list(self._claims)
        for c in claims:
            self.release(c)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_ms / 3000):
            with self._lock:
                names = [n for c in self._claims for n in c.keys]
            if not names:
                continue
            try:
                self._renew(keys=names, args=[self.owner, self.lease_ms])
            except redis.RedisError as e:
                log.warning("lease.renew_failed", extra={"reason": str(e), "leases": len(names)})


def leased_by_others(holders: Sequence[str | None], me: str) -> int:
    """How many leading chunks are leased by other workers (the run a waiter may wait for)."""
    n = 0
    for h in holders:
        if h is None or h == me:
            break
        n += 1
    return n
