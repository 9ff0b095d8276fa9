"""Fixtures for driving real worker processes: build jobs as the gateway would, read their results, compare with a cold run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import pytest
import redis

from store.fingerprint import fingerprint_file
from tests.conftest import POOL_CHUNK
from worker.client import events, submit
from worker.protocol import DoneEvent, ErrorEvent, JobResult, JobSpec, SamplingParams, StartEvent, TokenEvent, job_spec, worker_queue
from worker.settings import WorkerSettings


@dataclass
class Outcome:
    result: JobResult | None
    starts: list[StartEvent] = field(default_factory=list)
    tokens: list[TokenEvent] = field(default_factory=list)
    error: ErrorEvent | None = None

    @property
    def streamed_text(self) -> str:
        return "".join(t.text for t in self.tokens)


class PoolClient:
    """Submits jobs the way the gateway does: tokens, chain keys, tenant salt, sampling."""

    def __init__(self, conn: redis.Redis, model: Path, n_ctx: int = 2048) -> None:
        self.conn = conn
        self.settings = WorkerSettings(chunk_size=POOL_CHUNK, n_ctx=n_ctx)
        self.fingerprint = fingerprint_file(model)
        self.vocab = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)

    def tokens(self, text: str) -> list[int]:
        return self.vocab.tokenize(text.encode())

    def spec(self, tokens: list[int], *, tenant: str = "", chain: list[str] | None = None, **sampling: object) -> JobSpec:
        spec = job_spec(
            tokens,
            model=self.fingerprint,
            chunk_size=POOL_CHUNK,
            tenant_salt=tenant,
            sampling=SamplingParams(**{"max_tokens": 24, "temperature": 0.0, **sampling}),
        )
        return spec if chain is None else spec.model_copy(update={"chain": chain})

    def submit(self, spec: JobSpec, *, worker: str | None = None, attempts: int = 3) -> str:
        queue = worker_queue(worker) if worker else self.settings.queue
        return submit(self.conn, spec, queue=queue, attempts=attempts).id

    def collect(self, job_id: str, timeout_s: float = 120.0) -> Outcome:
        out = Outcome(result=None)
        for ev in events(self.conn, job_id, timeout_s=timeout_s):
            if isinstance(ev, StartEvent):
                out.starts.append(ev)
                out.tokens.clear()
            elif isinstance(ev, TokenEvent):
                out.tokens.append(ev)
            elif isinstance(ev, DoneEvent):
                out.result = ev.result
            elif isinstance(ev, ErrorEvent):
                out.error = ev
        return out

    def run(self, tokens: list[int], *, worker: str | None = None, **kw: object) -> JobResult:
        out = self.collect(self.submit(self.spec(tokens, **kw), worker=worker))
        assert out.result is not None, f"job failed: {out.error}"
        return out.result


@pytest.fixture
def client(redis_url: str, tiny_model: Path) -> PoolClient:
    return PoolClient(redis.Redis.from_url(redis_url), tiny_model)


@pytest.fixture(scope="session")
def uncuttable_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Generated models whose state kvpool cannot cut: ``tiny-swa`` (cohere2, sliding window), ``tiny-ssm`` (mamba, recurrent)."""
    from worker.models.synth import ensure_model

    folder = tmp_path_factory.mktemp("models")
    return {size: ensure_model(size, folder) for size in ("tiny-swa", "tiny-ssm")}
