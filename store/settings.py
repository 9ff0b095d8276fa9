"""Settings of the store, read from ``KVPOOL_`` environment variables.

Each process builds one settings object at start-up and passes it down; every other
settings class (`worker.settings.PoolSettings`, and the worker's and the gateway's on top
of it) extends this one.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class StoreSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVPOOL_", env_file=None, extra="ignore", env_ignore_empty=True)

    state_dir: Path = Field(Path(".kvpool"), description="Folder for local state: models, the filesystem store, managed Redis data.")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding the chunk index and the job queues.")
    store_url: str = Field(
        "",
        description="Where blobs live: a local directory, or s3://bucket/prefix. Empty: the store folder in KVPOOL_STATE_DIR.",
    )
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint, e.g. http://minio:9000. Empty means AWS.")
    s3_region: str = Field("us-east-1", description="S3 region name.")
    s3_access_key_id: str | None = Field(None, description="S3 access key (else boto3's usual credential chain).")
    s3_secret_access_key: str | None = Field(None, description="S3 secret key.")
    s3_create_bucket: bool = Field(True, description="Create the bucket at start-up when it does not exist.")
    tails_per_chunk: int = Field(
        8,
        ge=1,
        le=256,
        description="Prompt tails kept per stored chunk (the most recently used); a tail lets any worker resume at the exact token.",
    )
    store_max_bytes: int | None = Field(
        None,
        ge=0,
        description="Automatic eviction budget for stored blobs (bytes); 0: none. Empty: for a folder store, 20% of the room on its disk at start-up (free space plus what it holds), at most 32 GiB; for S3, 32 GiB. Each process logs the budget it uses (store.budget).",
    )
    reconcile_batch: int = Field(
        256,
        ge=0,
        le=100_000,
        description="Index entries checked against the blob backend per pass of the reconciliation that runs when S3 or Redis answers again after an outage; 0 turns it off.",
    )
    io_threads: int = Field(8, ge=1, le=256, description="Parallel blob GETs and PUTs per process.")
    connect_timeout_s: float = Field(2.0, gt=0, description="Connect timeout to S3 and Redis.")
    read_timeout_s: float = Field(10.0, gt=0, description="Read timeout to S3 and Redis.")
    retries: int = Field(2, ge=0, le=10, description="Retries of a failed S3 request.")

    def resolved_store_url(self) -> str:
        return self.store_url or str(self.state_dir / "store")
