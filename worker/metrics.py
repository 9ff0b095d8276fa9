"""Prometheus metrics of a worker (prefix ``kvpool_worker_``). Labels carry the model and KV layout."""

from enum import StrEnum

from prometheus_client import Counter, Gauge, Histogram, Info

_L = ["model", "layout"]
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

INFO = Info("kvpool_worker", "The worker's model, KV layout and whether it restores from the store.")
PROMPT_TOKENS = Counter("kvpool_worker_prompt_tokens_total", "Prompt tokens received.", _L)
REUSED_TOKENS = Counter("kvpool_worker_reused_tokens_total", "Prompt tokens reused from this worker's own context.", _L)
SIBLING_TOKENS = Counter(
    "kvpool_worker_sibling_copied_tokens_total",
    "Prompt tokens copied from another sequence of the same context (`worker.cache.siblings`).",
    _L,
)
RESTORED_TOKENS = Counter("kvpool_worker_restored_tokens_total", "Prompt tokens restored from the store.", _L)
EVALUATED_TOKENS = Counter("kvpool_worker_evaluated_tokens_total", "Prompt tokens evaluated by the model.", _L)
GENERATED_TOKENS = Counter("kvpool_worker_generated_tokens_total", "Tokens generated.", _L)
FIRST_TOKEN_SECONDS = Histogram("kvpool_worker_time_to_first_token_seconds", "Job start to first token.", _L, buckets=_SECONDS)
RESTORE_SECONDS = Histogram("kvpool_worker_restore_seconds", "Fetching, verifying and loading state from the store.", _L, buckets=_SECONDS)
RESTORE_BYTES = Counter("kvpool_worker_restore_bytes_total", "Bytes of state loaded from the store.", _L)
PUBLISH_SECONDS = Histogram("kvpool_worker_publish_seconds", "Cutting and publishing new chunks (in the background).", _L, buckets=_SECONDS)
PUBLISH_BYTES = Counter("kvpool_worker_publish_bytes_total", "Payload bytes published to the store.", _L)
PUBLISH_ERRORS = Counter("kvpool_worker_publish_errors_total", "Publish tasks that failed or were dropped.", _L + ["reason"])


class JobOutcome(StrEnum):
    """How a job ended: the ``outcome`` label of ``kvpool_worker_jobs_total`` (an answered job's is its finish reason)."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    """Never to be run: a bad or foreign job spec (`worker.errors.JobRejected`)."""
    ERROR = "error"
    """Failed while running; RQ retries it while attempts are left."""


JOBS = Counter("kvpool_worker_jobs_total", "Jobs by outcome.", _L + ["outcome"])
TOKENS_PER_SECOND = Histogram(
    "kvpool_worker_generation_tokens_per_second", "Generation speed per job.", _L, buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500)
)
RESTORE_ENABLED = Gauge("kvpool_worker_restore_enabled", "1 when the start-up layout check passed and restores are on.", _L)
EXACT = Gauge("kvpool_worker_exact_reuse", "1 when the self-check saw restored state give the cold run's very bits.", _L)
COLD_FALLBACKS = Counter(
    "kvpool_worker_cold_fallbacks_total", "Jobs evaluated cold that the store could have served, by reason.", _L + ["reason"]
)
BUSY = Gauge("kvpool_worker_busy", "1 while the worker runs a job.", _L)
LEASE_WAITS = Counter(
    "kvpool_worker_lease_waits_total",
    "Jobs that waited for a prefix another worker was evaluating, by outcome (released, timeout, error).",
    _L + ["outcome"],
)
LEASE_WAIT_SECONDS = Histogram("kvpool_worker_lease_wait_seconds", "Time waited for another worker's prefix.", _L, buckets=_SECONDS)
RESTORE_CHOICES = Counter(
    "kvpool_worker_restore_choices_total",
    "Jobs whose prompt the store held past the context, by what the worker chose: restore, partial (some chunks, the rest evaluated), evaluate, unmeasured (restore, nothing measured yet), small (restore, under 4 MiB).",
    _L + ["choice"],
)
RESTORE_RATE = Gauge(
    "kvpool_worker_restore_bytes_per_second", "This worker's moving estimate of its restore throughput (fetch, verify, load).", _L
)
EVAL_RATE = Gauge("kvpool_worker_eval_tokens_per_second", "This worker's moving estimate of its prompt evaluation rate.", _L)
