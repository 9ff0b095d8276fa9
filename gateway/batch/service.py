"""Running the Batch API's batches inside the gateway: one thread, one batch at a time, resumable anywhere.

See `gateway.batch.records` for the records, the lease and the results list this runs on.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

import redis

from gateway.batch.files import Files
from gateway.batch.lines import Line, Parsed, Rejected, parse_all, request_result_id, result_id_of
from gateway.batch.plan import Request, plan, prepare
from gateway.batch.records import ACTIVE_BATCHES_KEY, Batches, BatchStatus, RedisResults, RunnerLease
from gateway.batch.results import Tally
from gateway.batch.runner import BatchAborted, Runner
from gateway.errors import NotFound, Overloaded, to_api_error
from gateway.prepare import Preparer
from gateway.settings import GatewaySettings
from gateway.tenants import Tenant

log = logging.getLogger("kvpool.batches")

POLL_S = 1.0
"""How often an idle gateway looks for a batch to run."""


class Cancelled(Exception):
    """The batch was cancelled while it ran: raised from the runner's progress callback to unwind it.

    Control flow inside this module, not an API error: `BatchService.run` catches it and
    finishes the batch as ``cancelled``.
    """


def _check_endpoint(entry: Parsed | Rejected, endpoint: str) -> Parsed | Rejected:
    """A line must name the batch's own endpoint, as OpenAI requires."""
    if isinstance(entry, Parsed) and entry.chat != (endpoint == "/v1/chat/completions"):
        return Rejected(
            entry.line.number,
            request_result_id(entry.custom_id),
            entry.custom_id,
            "invalid_url",
            f"url must be the batch's endpoint {endpoint}",
        )
    return entry


def _lines(data: bytes) -> list[Line]:
    return [Line(n, raw.decode("utf-8", "replace").strip()) for n, raw in enumerate(data.splitlines(), start=1) if raw.strip()]


class BatchService:
    def __init__(self, settings: GatewaySettings, preparer: Preparer, files: Files, conn: redis.Redis[bytes]) -> None:
        self.settings = settings
        self.preparer = preparer
        self.files = files
        self.conn = conn
        self.batches = Batches(conn)
        self.owner = f"gateway-{uuid.uuid4().hex[:12]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvpool-batches", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.run_pending()
            except (redis.RedisError, Overloaded) as e:  # Redis or the store away: tried again on the next poll
                err = to_api_error(e)
                log.warning("batch.unavailable", extra={"code": err.code, "reason": f"{type(e).__name__}: {e}"})
            except Exception:
                log.exception("batch.loop_failed")

    def run_pending(self) -> bool:
        """Run the oldest batch nobody runs; False when there was none."""
        for batch_id in self.batches.active():
            lease = RunnerLease(self.conn, batch_id, self.owner, self.settings.batch_lease_s)
            if not lease.acquire():
                continue
            try:
                self.run(batch_id, lease.lost)
            finally:
                lease.release()
            return True
        return False

    def run(self, batch_id: str, lost: threading.Event | None = None) -> None:
        """Run one batch; one whose lease is ``lost`` to another gateway stops at its next answer (the other resumes it)."""
        rec = self.batches.load(batch_id)
        if rec is None:
            self.conn.zrem(ACTIVE_BATCHES_KEY, batch_id)
            return
        tenant = Tenant(rec["_tenant"], rec["_salt"])
        out = RedisResults(self.conn, batch_id).load()
        if rec["status"] == BatchStatus.CANCELLING:
            self._finish(rec, tenant, out, rec["request_counts"]["total"], BatchStatus.CANCELLED)
            return
        try:
            entries = [_check_endpoint(e, rec["endpoint"]) for e in parse_all(_lines(self.files.content(tenant, rec["input_file_id"])))]
        except NotFound as e:
            self.batches.update(
                batch_id,
                status=BatchStatus.FAILED,
                failed_at=int(time.time()),
                errors={"object": "list", "data": [{"code": "file_not_found", "message": e.message}]},
            )
            return
        total = len(entries)
        self.batches.update(
            batch_id,
            status=BatchStatus.IN_PROGRESS,
            in_progress_at=rec["in_progress_at"] or int(time.time()),
            request_counts=out.counts(total),
        )
        log.info("batch.running", extra={"batch": batch_id, "lines": total, "already_done": len(out.done), "gateway": self.owner})
        try:
            self._answer(batch_id, tenant, [e for e in entries if result_id_of(e) not in out.done], out, total, lost)
        except Cancelled:
            self._finish(self.batches.load(batch_id) or rec, tenant, out, total, BatchStatus.CANCELLED)
            return
        except BatchAborted as e:
            log.warning("batch.paused", extra={"batch": batch_id, "reason": str(e)})  # stays active: tried again later
            return
        self._finish(self.batches.load(batch_id) or rec, tenant, out, total, BatchStatus.COMPLETED)

    def _answer(
        self, batch_id: str, tenant: Tenant, todo: list[Parsed | Rejected], out: RedisResults, total: int, lost: threading.Event | None
    ) -> None:
        tally = Tally(lines=total)
        requests: list[Request] = []
        for entry in todo:
            item = prepare(entry, self.preparer, tenant) if isinstance(entry, Parsed) else entry
            if isinstance(item, Request):
                requests.append(item)
            else:
                out.write(item.record())
        last = [0.0]

        def changed() -> None:
            if lost is not None and lost.is_set():
                raise BatchAborted("its lease ran out and another gateway may run it now")
            if time.monotonic() - last[0] < 0.5:
                return
            last[0] = time.monotonic()
            rec = self.batches.update(batch_id, request_counts=out.counts(total))
            if rec["status"] == BatchStatus.CANCELLING:
                raise Cancelled

        window = max(1, self.settings.max_waiting_jobs // 2)
        runner = Runner(
            self.conn,
            self.settings,
            self.preparer.model_name,
            plan(requests, self.settings.chunk_size),
            out,
            tally,
            window=window,
            worker_grace_s=self.settings.batch_worker_grace_s,
            on_change=changed,
        )
        try:
            runner.run()
        except (Cancelled, BatchAborted):
            runner.cancel_all()
            raise

    def _finish(self, rec: dict[str, Any], tenant: Tenant, out: RedisResults, total: int, status: BatchStatus) -> None:
        """Write the output and error files, then mark the batch done."""
        ok: list[dict[str, Any]] = []
        bad: list[dict[str, Any]] = []
        for r in out.records:  # one pass: a membership test against ``ok`` was quadratic in the batch's size
            (ok if (r.get("response") or {}).get("status_code") == 200 else bad).append(r)

        def file_of(records: list[dict[str, Any]], kind: str) -> str | None:
            if not records:
                return None
            data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
            return self.files.create(tenant, f"{rec['id']}_{kind}.jsonl", "batch_output", data).id

        now = int(time.time())
        self.batches.update(
            rec["id"],
            status=status,
            output_file_id=file_of(ok, "output"),
            error_file_id=file_of(bad, "error"),
            request_counts=out.counts(total),
            finalizing_at=now,
            **{f"{status}_at": now},
        )
        self.conn.delete(out.key)
        log.info("batch.done", extra={"batch": rec["id"], "status": status, **out.counts(total)})
