"""Prometheus metrics of the gateway (prefix ``kvpool_gateway_``)."""

from prometheus_client import Counter, Gauge, Histogram

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter("kvpool_gateway_requests_total", "Requests by endpoint and status code.", ["endpoint", "status"])
LATENCY = Histogram("kvpool_gateway_request_seconds", "Request latency, to the last byte.", ["endpoint"], buckets=_SECONDS)
FIRST_TOKEN = Histogram("kvpool_gateway_time_to_first_token_seconds", "Request arrival to first token.", ["endpoint"], buckets=_SECONDS)
PROMPT_TOKENS = Counter("kvpool_gateway_prompt_tokens_total", "Prompt tokens of answered requests.")
CACHED_TOKENS = Counter("kvpool_gateway_cached_tokens_total", "Prompt tokens answered from cache, by source.", ["source"])
COMPLETION_TOKENS = Counter("kvpool_gateway_completion_tokens_total", "Completion tokens of answered requests.")
QUEUE_DEPTH = Gauge("kvpool_gateway_queue_depth", "Jobs waiting in all queues, as last seen.")
ROUTED = Counter("kvpool_gateway_routed_total", "Routing decisions, by reason.", ["reason"])
REJECTED = Counter("kvpool_gateway_rejected_total", "Requests turned away before enqueueing, by reason.", ["reason"])
TENANT_REQUESTS = Counter("kvpool_gateway_tenant_requests_total", "Requests by tenant id (never by key).", ["tenant"])
CANCELLED = Counter("kvpool_gateway_cancelled_total", "Jobs cancelled, by cause.", ["cause"])
RESUBMITTED = Counter(
    "kvpool_gateway_resubmitted_total",
    "Jobs queued again, by reason: Redis had lost them (redis_lost), or a worker popped one and died before starting it (stranded).",
    ["reason"],
)
IDEMPOTENT = Counter(
    "kvpool_gateway_idempotent_requests_total",
    "Requests with an Idempotency-Key, by outcome: new, attached (to the first attempt's jobs), rerun (those jobs failed, "
    "were cancelled or expired), conflict (another body).",
    ["outcome"],
)
