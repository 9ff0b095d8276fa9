"""The state one gateway process holds, built once by `gateway.app.create_app` and passed to every route."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis
import redis.asyncio
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from gateway.dispatch import Dispatcher, mismatch
from gateway.prepare import Prepared, Preparer
from gateway.relay import RelayContext
from gateway.settings import GatewaySettings
from gateway.starting import StartingPool
from gateway.streams import StreamReader
from gateway.tenants import Tenants
from store.backends import open_backend
from store.errors import StoreError
from worker.advert import adverts


class Gateway:
    """The state one gateway process holds: settings, tokenizer, tenants, Redis, dispatcher."""

    def __init__(self, settings: GatewaySettings, model_path: Path) -> None:
        self.settings = settings
        self.preparer = Preparer(settings, model_path)
        self.tenants = Tenants(settings.api_keys, settings.tenant_secret)
        self.redis = redis.Redis.from_url(
            settings.redis_url, socket_connect_timeout=settings.connect_timeout_s, socket_timeout=settings.read_timeout_s
        )
        self.aredis = redis.asyncio.Redis.from_url(settings.redis_url, socket_connect_timeout=settings.connect_timeout_s)
        self.reader = StreamReader(self.aredis)
        """The one reader of every job stream this gateway relays (`gateway.streams`)."""
        self.dispatcher = Dispatcher(self.redis, settings)
        self.starting = StartingPool(self.aredis, self.dispatcher, settings, self.preparer.fingerprint)

    def relay_context(self, request: Request, prepared: Prepared, job_id: str, t0: float, endpoint: str) -> RelayContext:
        async def any_worker_alive() -> bool:
            return bool(await run_in_threadpool(adverts, self.redis))

        async def resubmit() -> None:
            await run_in_threadpool(self.dispatcher.requeue, prepared.spec, job_id)

        return RelayContext(
            request,
            self.aredis,
            self.reader,
            job_id,
            self.settings.queue,
            t0,
            self.settings.request_timeout_s,
            endpoint,
            any_worker_alive,
            resubmit,
            self.dispatcher.job_time.observe,
        )

    def ready(self) -> dict[str, Any]:
        checks: dict[str, Any] = {}
        try:
            self.redis.ping()
            checks["redis"] = "ok"
        except redis.RedisError as e:
            checks["redis"] = f"unreachable: {e}"
        try:
            open_backend(self.settings).exists("readyz")
            checks["store"] = "ok"
        except StoreError as e:
            checks["store"] = str(e)
        try:
            live = adverts(self.redis)
            model, chunk = self.preparer.fingerprint, self.settings.chunk_size
            n = sum(a.serves(model, chunk) for a in live)
            checks["workers"] = n if n else (mismatch(live, model, chunk) if live else "no live worker")
            checks["layouts"] = sorted({a.layout for a in live if a.serves(model, chunk)})
            checks["kernels"] = sorted({a.kernels for a in live if a.serves(model, chunk) and a.kernels})
        except redis.RedisError:
            checks["workers"] = "unknown (redis unreachable)"
        return checks
