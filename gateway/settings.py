"""Settings of the gateway (``KVPOOL_`` environment variables).

They extend the pool's (`worker.settings.PoolSettings`, itself the store's plus what the
gateway and the workers must agree on): the gateway computes chain keys and submits jobs,
so it reads the same model file, chunk size, context size and queue as the workers.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from worker.settings import PoolSettings


class ToolFormatChoice(StrEnum):
    """How requests with tools are written (`gateway.toolformat.ToolFormat`)."""

    AUTO = "auto"
    HERMES = "hermes"
    GENERIC = "generic"


class GatewaySettings(PoolSettings):
    host: str = Field("127.0.0.1", description="Address the gateway listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port the gateway listens on.")
    model_name: str = Field("", description="Model id served in the API (default: the GGUF file name without .gguf).")
    chat_template_file: str = Field(
        "",
        description="Jinja chat template used instead of the model's own (as llama-server's --chat-template-file). "
        "Not needed for tools: a template that renders none gets them anyway (see the README's API).",
    )
    tool_format: ToolFormatChoice = Field(
        ToolFormatChoice.AUTO,
        description="How a request with tools is written. auto: by the chat template when it renders tools in the Hermes "
        "<tool_call> format, else in llama.cpp's generic JSON format, forced by a grammar (as llama-server does). hermes: a ChatML "
        "template without tools gets kvpool's Hermes ChatML template instead (answers stream as they come; the model chooses "
        "text or calls freely). generic: the generic format whatever the template.",
    )
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description='API keys and the tenant each belongs to, as JSON: {"sk-a": "team-a", "sk-b": "team-a"}. Empty: no auth, one tenant.',
    )
    tenant_secret: str = Field(
        "", description="Server-side secret mixed into each tenant's cache salt; set the same value on every gateway."
    )
    queue_without_workers: bool = Field(
        False,
        description="Queue requests while no worker is live (a pool scaled to zero on the queue's length): they wait for a worker to start instead of getting 503, and /readyz does not ask for a worker.",
    )
    start_wait_s: float = Field(
        120.0,
        ge=0,
        description="How long a request waits for a worker while the pool is starting (no worker has been live in this Redis yet, or "
        "worker processes are loading their model) instead of getting 503; counted in KVPOOL_REQUEST_TIMEOUT_S. A pool whose "
        "workers were live and are all gone answers 503 at once. 0: never wait.",
    )
    max_waiting_jobs: int = Field(64, ge=1, description="Waiting jobs beyond which requests get 503 with Retry-After.")
    route_max_queue: int = Field(
        0, ge=0, description="Jobs already queued at a worker beyond which locality routing gives way to the shared queue."
    )
    cache_key_max_queue: int = Field(
        8,
        ge=0,
        description="Jobs already queued at the worker a prompt_cache_key routes to (while no worker holds the prefix) beyond which "
        "such a request goes to the shared queue.",
    )
    redis_outage_s: float = Field(10.0, ge=0, description="How long a request waits for an unreachable Redis before 503.")
    request_timeout_s: float = Field(300.0, gt=0, description="Longest a request may wait for its answer (504 after).")
    idempotency_ttl_s: float = Field(
        0,
        ge=0,
        description="How long an Idempotency-Key is kept: a retry with the same key and body within it attaches to the first "
        "attempt's jobs. 0: KVPOOL_REQUEST_TIMEOUT_S + KVPOOL_STREAM_TTL_S (600 s by default), the longest an answer can be replayed.",
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body accepted (bytes).")
    max_file_bytes: int = Field(100 << 20, ge=1024, description="Largest file accepted by POST /v1/files (bytes).")
    batch_api: bool = Field(True, description="Serve the OpenAI Batch API (/v1/files, /v1/batches) and run its batches in this gateway.")
    batch_max_requests: int = Field(50_000, ge=1, description="Most requests in one Batch API input file.")
    batch_lease_s: float = Field(
        15.0, gt=0, description="How long a batch stays with a gateway that stopped renewing it before another resumes it."
    )
    batch_worker_grace_s: float = Field(
        60.0, gt=0, description="Seconds a running batch waits with no live worker before pausing (it is resumed later)."
    )
    stream_ping_s: float = Field(
        10.0,
        ge=0,
        description="Seconds a streamed Anthropic message may go without an event (a cold prompt being evaluated, say) before a "
        "ping event is sent, so that clients and proxies do not time out the idle stream. 0: no pings but the first.",
    )
    max_tokens_default: int = Field(256, ge=1, description="max_tokens when a chat request does not say.")
    responses_ttl_s: int = Field(
        30 * 24 * 3600, ge=1, description="How long a stored Responses API response (its items and token ids) is kept, seconds."
    )
    responses_max_bytes: int = Field(
        256 << 20, ge=1024, description="Bytes of stored Responses API responses kept per tenant; the oldest are dropped beyond it."
    )

    def idempotency_window_s(self) -> float:
        """How long an Idempotency-Key's record lives: set, or as long as a job's stream can outlive its first attempt."""
        return self.idempotency_ttl_s or self.request_timeout_s + self.stream_ttl_s
