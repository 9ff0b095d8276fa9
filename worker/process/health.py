"""The worker's one HTTP port (``KVPOOL_METRICS_PORT``): Prometheus metrics and the probes of an orchestrator.

* ``/metrics``: the process's Prometheus metrics.
* ``/healthz``: 200 while the process runs. It answers from the first moment, while the
  model is still loading, so a liveness probe does not kill a worker that is only slow
  to start; a worker waiting for Redis is alive too (it rides out outages by itself).
* ``/readyz``: 200 once the model is loaded, the start-up self-check has passed (or does
  not apply) and the worker is registered in Redis, which answers a ping: it takes jobs.
  503 with a short JSON reason before that, while Redis is lost, after a failed
  self-check and once a warm shutdown has begun. Once the model is loaded, the body also
  says what decides the worker's bits: its ``layout`` and ``kernels`` (`worker.kernels`),
  and whether it shares chunks across kernels.

The server is the standard library's, in daemon threads: it needs nothing of the RQ loop,
which keeps the main thread.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

log = logging.getLogger("kvpool.worker.health")


class Health:
    """What the probes report; `worker.process.main` updates it as the worker starts, works and stops."""

    def __init__(self, ping: Callable[[], object] | None = None) -> None:
        """``ping`` raises when Redis is unreachable; it is called by /readyz once all else is ready."""
        self._ping = ping
        self._lock = threading.Lock()
        self._model = "the model is loading"
        self._self_check = "pending"
        self._blocker: str | None = "the model is loading"
        self._registered = False
        self._stopping = False
        self._identity: dict[str, str] = {}

    def model_loaded(self, *, self_check: str, passed: bool, identity: dict[str, str] | None = None) -> None:
        """The engine is built; ``self_check`` says how its self-check went, ``passed`` whether restores may be trusted.

        ``identity``: what decides the worker's bits (layout, kernels), shown as it is.
        """
        with self._lock:
            self._identity = dict(identity or {})
            self._model = "loaded"
            self._self_check = self_check
            self._blocker = None if passed else f"the start-up self-check failed ({self_check})"

    def registered(self, registered: bool) -> None:
        with self._lock:
            self._registered = registered

    def failed(self, reason: str) -> None:
        """Never ready again: ``reason`` says why (a thread of the worker died, `worker.process.supervision`)."""
        with self._lock:
            self._blocker = reason
            self._stopping = False

    def stopping(self) -> None:
        with self._lock:
            self._stopping = True

    def report(self) -> tuple[bool, dict[str, Any]]:
        """(ready, the JSON body of /readyz)."""
        with self._lock:
            checks = {"model": self._model, "self_check": self._self_check, "registered": self._registered}
            identity = dict(self._identity)
            if self._stopping:
                reason: str | None = "shutting down: finishing the job in hand"
            elif self._blocker is not None:
                reason = self._blocker
            elif not self._registered:
                reason = "not registered in Redis (waiting for it)"
            else:
                reason = None
        if reason is None and self._ping is not None:
            try:
                self._ping()
            except Exception as e:  # any failure to reach Redis means: no jobs come in
                reason = f"Redis is unreachable: {type(e).__name__}"
        body: dict[str, Any] = {"status": "ready" if reason is None else "not ready", "checks": checks, **identity}
        if reason is not None:
            body["reason"] = reason
        return reason is None, body


def self_check_outcome(cuttable: bool, enabled: bool, restore_enabled: bool, exact: bool) -> tuple[str, bool]:
    """How the engine's self-check went, as (what to report, whether readiness may follow).

    A layout that cannot be cut is served cold by design: the check does not apply and
    the worker is ready. A check that ran and failed keeps the worker unready, so that a
    rollout of a bad image or KV layout stops where it is seen.
    """
    if not cuttable:
        return "not applicable: this KV layout is served without restores", True
    if not enabled:
        return "skipped (KVPOOL_SELF_CHECK=false)", True
    if restore_enabled:
        return "passed, exact" if exact else "passed, inexact", True
    return "failed: a restored prefix does not reproduce the cold logits", False


class _Handler(BaseHTTPRequestHandler):
    health: Health

    def do_GET(self) -> None:  # http.server's name
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            self._json(200, {"status": "ok"})
        elif path == "/readyz":
            ready, body = self.health.report()
            self._json(200 if ready else 503, body)
        else:
            self._json(404, {"error": f"no such endpoint: {path}; try /metrics, /healthz or /readyz"})

    def _json(self, code: int, body: dict[str, Any]) -> None:
        self._send(code, json.dumps(body).encode(), "application/json")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds are not news
        pass


def serve(health: Health, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve /metrics, /healthz and /readyz on ``port`` (0: any free port) in a daemon thread."""
    handler = type("HealthHandler", (_Handler,), {"health": health})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kvpool-health", daemon=True).start()
    log.info("metrics.serving", extra={"port": server.server_port, "endpoints": "/metrics /healthz /readyz"})
    return server
