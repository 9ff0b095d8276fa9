"""The OpenAI Batch API over HTTP: batch records in Redis, run by whichever gateway holds a batch's lease.

A batch's record (`BATCH_PREFIX`) is OpenAI's Batch object plus the
tenant it belongs to; every lookup checks the tenant, so another tenant's batch is a
plain 404. A new batch joins the active set, and each gateway's `BatchService` thread
takes the oldest one whose runner lease is free, renews the lease while it runs it and
drops it when done. The run is `kvpool batch`'s: the same parsing, prefix-aware
planning (`gateway.batch.plan`) and runner (`gateway.batch.runner`), with jobs in RQ.
Each result line is appended to a Redis list as it is answered, so a gateway that dies
loses no batch: once its lease expires another gateway (or the same one, restarted)
resumes the batch and answers only what is missing. When every line is answered, the
lines go to an output file (status 200) and an error file (the rest), and the batch is
``completed``.
"""

from __future__ import annotations

import builtins
import json
import logging
import threading
import time
import uuid
from enum import StrEnum
from typing import Any, cast

import redis
from redis.exceptions import LockNotOwnedError
from redis.lock import Lock

from gateway.errors import InvalidRequest, NotFound
from gateway.tenants import Tenant

BATCH_PREFIX = "kvpool:batch:"
"""``kvpool:batch:<id>``: string, the Batch API's record (JSON); ``<id>:results``: list of result
lines answered so far; ``<id>:runner``: string, the gateway running it, expiring."""
TENANT_BATCHES_PREFIX = "kvpool:batches:"
"""``kvpool:batches:<tenant>``: sorted set of a tenant's batch ids by creation time."""
ACTIVE_BATCHES_KEY = "kvpool:batches-active"
"""Sorted set of the batches not finished yet, by creation time: what gateways pick up and run."""

log = logging.getLogger("kvpool.batches")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class BatchStatus(StrEnum):
    """A batch's ``status``, as OpenAI's Batch object names them (each but ``finalizing`` is one kvpool sets)."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


FINAL = frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.CANCELLED, BatchStatus.EXPIRED})
"""The statuses a batch never leaves."""


def _tenant_key(tenant: Tenant) -> str:
    return TENANT_BATCHES_PREFIX + tenant.salt[:24]


class Batches:
    """Batch records: created by the API, updated by the runner, read back per tenant."""

    def __init__(self, conn: redis.Redis[bytes]) -> None:
        self.conn = conn

    def create(self, tenant: Tenant, input_file_id: str, endpoint: str, window: str, metadata: dict[str, str] | None) -> dict[str, Any]:
        if endpoint not in ENDPOINTS:
            raise InvalidRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint", code="invalid_endpoint")
        if window != "24h":
            raise InvalidRequest("completion_window must be '24h'", param="completion_window")
        now = int(time.time())
        rec: dict[str, Any] = {
            "id": f"batch_{uuid.uuid4().hex[:24]}",
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": window,
            "status": BatchStatus.VALIDATING,
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + 24 * 3600,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
            "_tenant": tenant.id,
            "_salt": tenant.salt,
        }
        pipe = self.conn.pipeline()
        pipe.set(BATCH_PREFIX + rec["id"], json.dumps(rec))
        pipe.zadd(_tenant_key(tenant), {rec["id"]: now})
        pipe.zadd(ACTIVE_BATCHES_KEY, {rec["id"]: now})
        pipe.execute()
        return rec

    def load(self, batch_id: str) -> dict[str, Any] | None:
        raw = self.conn.get(BATCH_PREFIX + batch_id)
        return json.loads(raw) if raw else None

    def get(self, tenant: Tenant, batch_id: str) -> dict[str, Any]:
        rec = self.load(batch_id) if batch_id.startswith("batch_") else None
        if rec is None or rec["_salt"] != tenant.salt:
            raise NotFound(f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
        return rec

    def update(self, batch_id: str, **fields: Any) -> dict[str, Any]:
        """Change fields of a record atomically (a cancel may race with the runner)."""

        def change(pipe: redis.client.Pipeline[bytes]) -> dict[str, Any]:
            rec: dict[str, Any] = json.loads(cast(bytes, pipe.get(BATCH_PREFIX + batch_id)))  # WATCHed: a read, not a queued command
            if rec["status"] == BatchStatus.CANCELLING and fields.get("status") == BatchStatus.IN_PROGRESS:
                fields.pop("status")
            rec.update(fields)
            pipe.multi()
            pipe.set(BATCH_PREFIX + batch_id, json.dumps(rec))
            if rec["status"] in FINAL:
                pipe.zrem(ACTIVE_BATCHES_KEY, batch_id)
            return rec

        rec: dict[str, Any] = self.conn.transaction(change, BATCH_PREFIX + batch_id, value_from_callable=True)
        return rec

    def cancel(self, tenant: Tenant, batch_id: str) -> dict[str, Any]:
        rec = self.get(tenant, batch_id)
        if rec["status"] in FINAL or rec["status"] == BatchStatus.CANCELLING:
            return rec
        return self.update(batch_id, status=BatchStatus.CANCELLING, cancelling_at=int(time.time()))

    def list(self, tenant: Tenant, limit: int, after: str | None) -> tuple[builtins.list[dict[str, Any]], bool]:
        """The tenant's batches, newest first, after the one named; and whether there are more."""
        key = _tenant_key(tenant)
        start = 0
        if after is not None:
            rank = self.conn.zrevrank(key, after)
            if rank is None:
                return [], False
            start = int(rank) + 1
        ids = [i.decode() for i in self.conn.zrevrange(key, start, start + limit)]
        recs = [r for r in (self.load(i) for i in ids) if r is not None]
        return recs[:limit], len(recs) > limit

    def active(self) -> builtins.list[str]:
        return [i.decode() for i in self.conn.zrange(ACTIVE_BATCHES_KEY, 0, -1)]


def public(rec: dict[str, Any]) -> dict[str, Any]:
    """The record as the API shows it: OpenAI's Batch object, without the tenant."""
    return {k: v for k, v in rec.items() if not k.startswith("_")}


class RedisResults:
    """The runner's output (`gateway.batch.results.ResultFile`'s interface), as a Redis list that outlives a gateway."""

    def __init__(self, conn: redis.Redis[bytes], batch_id: str) -> None:
        self.conn = conn
        self.key = BATCH_PREFIX + batch_id + ":results"
        self.done: set[str] = set()
        self.records: list[dict[str, Any]] = []

    def load(self) -> RedisResults:
        self.records = [json.loads(r) for r in self.conn.lrange(self.key, 0, -1)]
        self.done = {r["id"] for r in self.records}
        return self

    def write(self, record: dict[str, Any]) -> None:
        if record["id"] in self.done:
            return
        self.conn.rpush(self.key, json.dumps(record, separators=(",", ":")))
        self.records.append(record)
        self.done.add(record["id"])

    def counts(self, total: int) -> dict[str, int]:
        ok = sum(1 for r in self.records if (r.get("response") or {}).get("status_code") == 200)
        return {"total": total, "completed": ok, "failed": len(self.records) - ok}

    def close(self) -> None:
        """Nothing to flush: every line is in Redis once written."""


class RunnerLease:
    """One gateway runs a batch at a time: redis-py's `Lock` on ``<id>:runner``, renewed by a thread while it runs.

    The lock's token is the gateway's name, so the key says who runs the batch. Renewing
    (`Lock.reacquire`) and releasing are Lua scripts that act only while the token is still
    this gateway's: one that stalled past its lease, and lost the batch to another, neither
    extends nor deletes the other's lease. It sets `lost` and stops renewing instead.
    """

    def __init__(self, conn: redis.Redis[bytes], batch_id: str, owner: str, lease_s: float) -> None:
        self.key, self.owner, self.lease_s = BATCH_PREFIX + batch_id + ":runner", owner, lease_s
        self.lock = Lock(conn, self.key, timeout=lease_s, blocking=False, thread_local=False)
        self.lost = threading.Event()
        """Set once a renewal found the lease held by another gateway (or by nobody)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> bool:
        if not self.lock.acquire(token=self.owner):
            return False
        self._thread = threading.Thread(target=self._renew_loop, name="kvpool-batch-lease", daemon=True)
        self._thread.start()
        return True

    def renew(self) -> bool:
        """Reset the lease to its full length; False once it is no longer this gateway's."""
        try:
            self.lock.reacquire()
        except LockNotOwnedError:
            self.lost.set()
            log.warning("batch.lease_lost", extra={"lease": self.key, "gateway": self.owner})
            return False
        except redis.RedisError as e:
            log.warning("batch.lease_renew_failed", extra={"reason": str(e)})
        return True

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3) and self.renew():
            pass

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        try:
            self.lock.release()
        except redis.RedisError:
            pass  # lost to another gateway (LockNotOwnedError), or Redis is away: the lease expires by itself
