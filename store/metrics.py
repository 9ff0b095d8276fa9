"""Prometheus metrics of the store (prefix ``kvpool_store_``), shared by every process that opens a store."""

from prometheus_client import Counter, Gauge, Histogram

LOOKUPS = Counter("kvpool_store_lookups_total", "Chain lookups against the index.")
CHUNKS = Counter("kvpool_store_chunks_total", "Chunks looked up, by result.", ["result"])
TOKENS = Counter("kvpool_store_tokens_total", "Prompt tokens looked up (full chunks and tails), by result.", ["result"])
BYTES_READ = Counter("kvpool_store_bytes_read_total", "Blob bytes read from the backend.")
BYTES_WRITTEN = Counter("kvpool_store_bytes_written_total", "Blob bytes written to the backend.")
REQUEST_SECONDS = Histogram(
    "kvpool_store_request_seconds",
    "Latency of one backend request, by operation.",
    ["op"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
CORRUPT = Counter("kvpool_store_corrupt_blobs_total", "Blobs rejected by verification, by reason.", ["reason"])
EVICTIONS = Counter("kvpool_store_evictions_total", "Chunks evicted to keep within the byte budget.")
EVICTED_BYTES = Counter("kvpool_store_evicted_bytes_total", "Bytes evicted to keep within the byte budget.")
STALE = Counter(
    "kvpool_store_stale_index_entries_total", "Index entries dropped because their blob was gone, or the blob of a chunk they hang from."
)
RECONCILED = Counter("kvpool_store_reconciled_entries_total", "Index entries checked against the backend after an outage.")
BYTES_STORED = Gauge("kvpool_store_bytes_stored", "Bytes of indexed blobs, as last seen by this process.")
UNAVAILABLE = Counter("kvpool_store_unavailable_total", "Operations that failed because S3 or Redis was unreachable.", ["component"])
