"""``Idempotency-Key``: a retried request finds the jobs its first attempt started, on whichever gateway it lands.

A client that lost its connection (its gateway died, a proxy dropped it) sends the same
request again with the same key. The jobs of the first attempt went on running on the
workers and wrote their events to their Redis streams, so the retry attaches to those
streams: it replays what was produced and follows them to the end, streaming or not,
and no job is enqueued twice.

The key's record lives in Redis under ``kvpool:idempotency:<sha256(tenant, key)>`` (so a
tenant never sees another's keys) with the SHA-256 of the request's canonical body (its
path and its JSON with sorted keys, so whitespace and key order do not matter). It
passes through two states:

* ``claimed``: one gateway won the key (``SET NX``, one round trip, so two gateways
  racing with the same key enqueue one job) and is enqueueing the jobs the claim names
  (their ids are chosen first); the record expires after ``CLAIM_S`` plus the Redis
  outage allowance if that gateway dies first (a live one renews it while it waits for a
  starting pool's first worker: `_hold`), and a request that finds it waits for it
  to change, or attaches to the named jobs once they are all in RQ (a gateway killed
  after enqueueing and before recording leaves them running);
* ``submitted``: the jobs are enqueued; the record lasts ``KVPOOL_IDEMPOTENCY_TTL_S``.

A request with the key and another body is a 409. One whose first attempt cannot be
replayed (a job failed, was cancelled because its client left or timed out, or its
stream expired or was trimmed) takes the key over and runs anew; so does one whose first attempt was
refused before it was enqueued (the claim is released). Every generation endpoint gets
all of this by calling `submit_once` instead of `gateway.answer.submit_all`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from enum import StrEnum
from functools import partial
from typing import Any

import anyio
import redis
import redis.asyncio
from fastapi import Request
from pydantic import BaseModel

from gateway import metrics
from gateway.answer import Submitted, submit_all
from gateway.errors import Conflict, InvalidRequest, Timeout
from gateway.prepare import Prepared
from gateway.settings import GatewaySettings
from gateway.state import Gateway
from gateway.tenants import Tenant
from worker.client import RUNNING, entry_events, job_key, job_status
from worker.protocol import DoneEvent, ErrorEvent, StartEvent, cancel_key, stream_key
from worker.redis_retry import aride_out

log = logging.getLogger("kvpool.gateway")

IDEMPOTENCY_PREFIX = "kvpool:idempotency:"
"""``kvpool:idempotency:<sha256 of tenant and key>``: string, a key's `Record` as JSON, expiring."""
HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
"""Stripe's bound: room for a UUID or a client's own composite key, not for a payload."""
CLAIM_S = 30.0
"""How long a claim outlives a gateway that died before enqueueing (besides the Redis outage it may wait out)."""
POLL_S = 0.05
"""RQ statuses of a job that will still write to its stream."""

_SWAP = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end
return 1
"""


class KeyState(StrEnum):
    CLAIMED = "claimed"
    SUBMITTED = "submitted"


class Record(BaseModel):
    state: KeyState
    body: str
    """SHA-256 of the canonical request body."""
    owner: str
    """The claim's own id, so that only its gateway moves it on."""
    jobs: list[str] = []


def request_key(request: Request) -> str | None:
    """The request's ``Idempotency-Key``, or None without one; an empty or too long key is a 400."""
    key = request.headers.get(HEADER)
    if key is None:
        return None
    if not key.strip():
        raise InvalidRequest(f"the {HEADER} header is empty", param=HEADER, code="invalid_idempotency_key")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidRequest(
            f"the {HEADER} header holds {len(key)} characters; at most {MAX_KEY_CHARS}", param=HEADER, code="invalid_idempotency_key"
        )
    return key


def record_key(tenant_id: str, key: str) -> str:
    return IDEMPOTENCY_PREFIX + hashlib.sha256(f"{tenant_id}\0{key}".encode()).hexdigest()


def body_digest(path: str, body: bytes) -> str:
    """SHA-256 of the endpoint and the body's JSON with sorted keys and no whitespace."""
    canonical = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{path}\n{canonical}".encode()).hexdigest()


class Records:
    """The records in Redis: claim with ``SET NX``, read, and move on only what is still as read (one script)."""

    def __init__(self, aredis: redis.asyncio.Redis[bytes], settings: GatewaySettings) -> None:
        self.aredis = aredis
        self.outage_s = settings.redis_outage_s
        self.ttl_ms = int(settings.idempotency_window_s() * 1000)
        self.claim_ms = int((CLAIM_S + settings.redis_outage_s) * 1000)
        self._swap = aredis.register_script(_SWAP)

    async def claim(self, key: str, record: Record) -> bool:
        value = record.model_dump_json()
        return bool(await aride_out(lambda: self.aredis.set(key, value, nx=True, px=self.claim_ms), self.outage_s, what="idempotency"))

    async def get(self, key: str) -> tuple[bytes, Record] | None:
        raw = await aride_out(lambda: self.aredis.get(key), self.outage_s, what="idempotency")
        return None if raw is None else (raw, Record.model_validate_json(raw))

    async def swap(self, key: str, expected: bytes | str, new: Record | None) -> bool:
        """Replace the record (or delete it, with None) only if it is still ``expected``."""
        if new is None:
            value, ttl = "", 0
        else:
            value, ttl = new.model_dump_json(), self.ttl_ms if new.state is KeyState.SUBMITTED else self.claim_ms
        return bool(await aride_out(lambda: self._swap(keys=[key], args=[expected, value, ttl]), self.outage_s, what="idempotency"))


async def replayable(aredis: redis.asyncio.Redis[bytes], job_ids: list[str]) -> bool:
    """Whether every job can still be read to a good end: its stream whole (or still to come), not cancelled, not failed."""
    for job_id in job_ids:
        pipe = aredis.pipeline(transaction=False)
        pipe.exists(cancel_key(job_id))
        pipe.xrange(stream_key(job_id), count=1)
        pipe.xrevrange(stream_key(job_id), count=1)
        pipe.hget(job_key(job_id), "status")
        cancelled, first, last, status = await pipe.execute()
        if cancelled or not _readable(first, last, job_status(status) in RUNNING):
            return False
    return True


def _readable(first: list[Any], last: list[Any], running: bool) -> bool:
    if not last:  # not started yet, or its stream expired
        return running
    if not isinstance(entry_events(first[0][1])[0], StartEvent):  # trimmed: its first tokens are gone
        return False
    event = entry_events(last[0][1])[-1]
    if isinstance(event, DoneEvent):
        return event.result.finish_reason != "cancelled"
    if isinstance(event, ErrorEvent) and not event.retrying:
        return False
    return running  # mid-answer, or between two attempts


async def submit_once(gw: Gateway, request: Request, prepared: list[Prepared], tenant: Tenant) -> list[Submitted]:
    """`submit_all`, once per ``Idempotency-Key``: a request that repeats a keyed one gets the first one's jobs."""
    key = request_key(request)
    if key is None:
        return await submit_all(gw, prepared, tenant)
    records, rkey = Records(gw.aredis, gw.settings), record_key(tenant.id, key)
    digest = body_digest(request.url.path, await request.body())
    deadline = time.monotonic() + gw.settings.request_timeout_s
    while time.monotonic() < deadline:
        mine = Record(state=KeyState.CLAIMED, body=digest, owner=uuid.uuid4().hex, jobs=[str(uuid.uuid4()) for _ in prepared])
        if await records.claim(rkey, mine):
            return await _submit_claimed(gw, records, rkey, mine, prepared, tenant, "new")
        found = await records.get(rkey)
        if found is None:
            continue  # released or expired since: claim it
        raw, record = found
        if record.body != digest:
            metrics.IDEMPOTENT.labels("conflict").inc()
            raise Conflict(
                f"this {HEADER} was already used with another request body; send a new key for a new request",
                param=HEADER,
                code="idempotency_key_reused",
            )
        if record.state is KeyState.CLAIMED and not await _claimed_jobs_enqueued(gw, record, prepared):
            await asyncio.sleep(POLL_S)  # another gateway is enqueueing the jobs
            continue
        if len(record.jobs) == len(prepared) and await aride_out(
            partial(replayable, gw.aredis, record.jobs), gw.settings.redis_outage_s, what="idempotency"
        ):
            return _attach(record, prepared, tenant)
        if await records.swap(rkey, raw, mine):
            return await _submit_claimed(gw, records, rkey, mine, prepared, tenant, "rerun")
    raise Timeout(f"the request holding this {HEADER} did not enqueue its jobs in time; retry", code="timeout")


async def _claimed_jobs_enqueued(gw: Gateway, record: Record, prepared: list[Prepared]) -> bool:
    """Whether every job a claim names is in RQ: its gateway enqueued them, and may have died before recording so.

    A claim names its jobs before they are enqueued, so a retry attaches to the jobs of a
    gateway killed between enqueueing and recording, instead of running them a second time.
    """
    if len(record.jobs) != len(prepared):
        return False
    found = await aride_out(lambda: gw.aredis.exists(*(job_key(j) for j in record.jobs)), gw.settings.redis_outage_s, what="idempotency")
    return int(found) == len(record.jobs)


def _attach(record: Record, prepared: list[Prepared], tenant: Tenant) -> list[Submitted]:
    jobs = [Submitted(p, job_id, i * p.spec.sampling.n) for i, (p, job_id) in enumerate(zip(prepared, record.jobs))]
    metrics.IDEMPOTENT.labels("attached").inc()
    metrics.TENANT_REQUESTS.labels(tenant.id).inc()
    log.info("request.attached", extra={"job": record.jobs[0], "jobs": len(record.jobs), "tenant": tenant.id})
    return jobs


async def _submit_claimed(
    gw: Gateway, records: Records, rkey: str, mine: Record, prepared: list[Prepared], tenant: Tenant, outcome: str
) -> list[Submitted]:
    """Enqueue under a claim we hold; record the jobs, or release the key if the request was refused."""
    held = mine.model_dump_json()
    keeper = asyncio.create_task(_hold(records, rkey, held, mine))
    try:
        jobs = await submit_all(gw, prepared, tenant, mine.jobs)
    except BaseException:
        keeper.cancel()
        with anyio.CancelScope(shield=True):
            try:
                await records.swap(rkey, held, None)
            except redis.RedisError as e:
                log.warning("idempotency.release_failed", extra={"reason": str(e)})  # the claim expires on its own
        raise
    keeper.cancel()
    done = mine.model_copy(update={"state": KeyState.SUBMITTED, "jobs": [j.job_id for j in jobs]})
    try:
        recorded = await records.swap(rkey, held, done)
    except redis.RedisError as e:
        recorded = False  # the jobs run all the same; a retry after the claim expires runs anew
        log.warning("idempotency.record_failed", extra={"job": jobs[0].job_id, "reason": str(e)})
    if not recorded:
        log.warning("idempotency.claim_lost", extra={"job": jobs[0].job_id, "reason": "the key's claim expired or was lost"})
    metrics.IDEMPOTENT.labels(outcome).inc()
    return jobs


async def _hold(records: Records, rkey: str, held: str, mine: Record) -> None:
    """Renew a claim while its gateway is enqueueing (a wait for a starting pool may outlast `CLAIM_S`), while it is still ours."""
    try:
        while await asyncio.sleep(CLAIM_S / 3, True) and await records.swap(rkey, held, mine):
            pass
    except redis.RedisError as e:
        log.warning("idempotency.renew_failed", extra={"reason": str(e)})
