"""What a job is, what it streams and what it returns: the contract between the gateway and the workers.

No llama.cpp here: the gateway imports this module to build jobs and read their streams.

A job's tokens go out on a Redis stream (``kvpool:stream:<job id>``) as they are made. An
entry holds one or more events, one JSON object a line in its field ``e``; ``w`` names the
writer (one per attempt) and ``n`` is the number of the entry's last event among the
writer's, counted from 1 (`entry`, `Once`):

* ``{"type": "start", "attempt": 1, "worker": "..."}`` -- each attempt begins anew (a
  job whose worker died is run again by another, from the start)
* ``{"type": "token", "text": "...", "token": 123, "logprob": -0.4, "top_logprobs": {...}}``
* ``{"type": "done", "result": {...JobResult...}}``
* ``{"type": "error", "error": "...", "retrying": false}``

The first token is written as soon as it is sampled. Tokens that follow it within
``KVPOOL_STREAM_INTERVAL_MS`` of the last write wait for the next write and go in one
entry, so a reader gets them in one reply (`worker.process.jobstream.JobStream`). The stream is
trimmed to a bounded length and expires a while after its last entry. A client that goes
away sets ``kvpool:cancel:<job id>``; the worker checks it at every write and stops within
that interval.

A write is retried when Redis goes away during it, and Redis may have applied the write
before it went (a Redis shut down after it ran the write but before it replied), or a
write that failed for good leaves its events to the next, which writes them again with
newer ones. Readers drop every event whose number they have seen, with `Once`, so every
event counts once. (A reader older than this format reads one event an entry: upgrade the
gateways before the workers.)
"""

from __future__ import annotations

import secrets
import time
from typing import Literal

import xxhash
from pydantic import BaseModel, Field

from store.chain import prefix_namespace

STREAM_PREFIX = "kvpool:stream:"
CANCEL_PREFIX = "kvpool:cancel:"
WORKER_QUEUE_PREFIX = "kvpool:worker:"
ADVERTS_KEY = "kvpool:adverts"
"""Hash of worker name -> advert JSON (`worker.advert`)."""
LEASE_PREFIX = "kvpool:lease:"
"""``kvpool:lease:<chunk key hex>``: string, the name of the worker evaluating that chunk, expiring (`worker.cache.leases`)."""


def stream_key(job_id: str) -> str:
    return STREAM_PREFIX + job_id


def entry(lines: list[str], writer: str, last: int) -> dict[str, str | int]:
    """The stream entry of a writer's events numbered ``last - len(lines) + 1`` to ``last`` (one JSON object each, no line breaks)."""
    return {"e": "\n".join(lines), "w": writer, "n": last}


class Once:
    """Which entries of one job's stream a reader takes: each once, and only those of the job's latest attempt.

    * A writer's events reach the stream in the order of their numbers, so an event whose
      number is not above the last seen from its writer repeats one (a write retried after
      Redis applied it but lost its reply, or events a failed write left to the next):
      `take` leaves it out.
    * Each attempt writes through a writer of its own (`worker.process.jobstream.JobStream`) and starts
      with a start event. RQ may retry a job whose first attempt still runs (its heartbeat
      lapsed during a Redis pause), and then both write to the stream: `current` is False
      for any entry of a writer other than the one whose start came last, so a reader
      never joins one attempt's tokens to another's.

    Entries without ``w`` and ``n`` (written by a worker older than this format) are all taken.
    """

    def __init__(self) -> None:
        self._last: dict[bytes, int] = {}
        self._attempt: bytes | None = None

    def take(self, fields: dict[bytes, bytes]) -> list[bytes]:
        """The entry's event lines not seen before: those numbered after the last seen from its writer."""
        lines = fields[b"e"].split(b"\n")
        writer, n = fields.get(b"w"), fields.get(b"n")
        if writer is None or n is None:
            return lines
        last, seen = int(n), self._last.get(writer, 0)
        if last <= seen:
            return []
        self._last[writer] = last
        return lines[max(0, len(lines) - (last - seen)) :]

    def current(self, fields: dict[bytes, bytes], starts: bool) -> bool:
        """Whether a fresh event belongs to the latest attempt; ``starts``: it is a start event (its writer becomes the latest)."""
        writer = fields.get(b"w")
        if starts:
            self._attempt = writer
            return True
        return writer is None or self._attempt is None or writer == self._attempt


def cancel_key(job_id: str) -> str:
    return CANCEL_PREFIX + job_id


def lease_key(chunk_key: bytes) -> str:
    return LEASE_PREFIX + chunk_key.hex()


def worker_queue(worker_name: str) -> str:
    """The queue only this worker listens to (before the shared one)."""
    return WORKER_QUEUE_PREFIX + worker_name


class SamplingParams(BaseModel):
    max_tokens: int = Field(16, ge=0)
    temperature: float = Field(0.8, ge=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    top_k: int = Field(40, ge=0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: list[str] = Field(default_factory=list)
    logprobs: int | None = Field(None, ge=0, le=20)
    logit_bias: dict[int, float] = Field(default_factory=dict, description="Token id -> bias added to its logit (-100 bans it).")
    n: int = Field(1, ge=1, le=16, description="Choices sampled from the one evaluated prompt.")
    grammar: str | None = Field(None, description="GBNF (root rule 'root') every choice must match; the gateway has checked it.")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="Score the prompt: each token's logprob and this many alternatives.")


MAX_BREAKPOINTS = 4


class Breakpoint(BaseModel):
    """A prefix of the prompt to keep: published at once, whatever becomes of the answer, and pinned in the store."""

    tokens: int = Field(ge=1, description="The prompt's first this many tokens.")
    ttl_s: float = Field(gt=0, le=86_400, description="How long the store keeps them from eviction.")


class JobSpec(BaseModel):
    """One completion request, already tokenized and hashed by the gateway."""

    tokens: list[int] = Field(min_length=1)
    chain: list[str] = Field(description="Hex keys of the prompt's full chunks, as the gateway computed them.")
    chunk_size: int = Field(ge=1)
    model: str = Field(description="Model fingerprint the gateway tokenized for.")
    tenant_salt: str = ""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    enqueued_at: float = Field(description="Unix time the gateway enqueued the job (for queue wait).")
    wait_for_publish: bool = Field(
        False, description="Return only once the new chunks are in the store (batch leaders whose siblings wait on them)."
    )
    breakpoints: list[Breakpoint] = Field(default_factory=list, max_length=MAX_BREAKPOINTS)
    route_key: str | None = Field(
        None, description="Hash of the tenant and the request's prompt_cache_key: where to route while no worker holds the prefix."
    )
    message_starts: list[int] = Field(
        default_factory=list,
        max_length=8,
        description="Prompt positions where a chat message starts (the last one): where the next request most likely parts "
        "from this one, so a worker whose model's state is stored whole saves a checkpoint there (`worker.cache.checkpoints`).",
    )

    def misfit(self, model: str, chunk_size: int, n_ctx: int, n_vocab: int) -> str | None:
        """Why a worker serving ``model`` with this chunk size, context and vocabulary cannot run the job; None if it can."""
        if self.model != model:
            return f"job is for model {self.model}, this worker serves {model}"
        if self.chunk_size != chunk_size:
            return f"job uses chunk size {self.chunk_size}, this worker {chunk_size}"
        if len(self.tokens) >= n_ctx:
            return f"prompt of {len(self.tokens)} tokens does not fit the context of {n_ctx}"
        if any(b.tokens > len(self.tokens) for b in self.breakpoints):
            return f"a breakpoint lies past the prompt's {len(self.tokens)} tokens"
        if any(not 0 < m < len(self.tokens) for m in self.message_starts):
            return f"a message start lies outside the prompt's {len(self.tokens)} tokens"
        if any(t < 0 or t >= n_vocab for t in [*self.tokens, *self.sampling.logit_bias]):
            return f"token ids must lie in [0, {n_vocab})"
        return None


def job_spec(
    tokens: list[int],
    *,
    model: str,
    chunk_size: int,
    tenant_salt: str = "",
    sampling: SamplingParams | None = None,
    enqueued_at: float | None = None,
    wait_for_publish: bool = False,
    route_key: str | None = None,
    message_starts: list[int] | None = None,
) -> JobSpec:
    """The one way to build a job: its prefix keys are hashed here, from its tokens (`store.chain.prefix_namespace`).

    ``route_key`` is the request's ``prompt_cache_key``; it is hashed with the tenant's salt,
    so two tenants' keys never meet.

    A sampled job without a seed gets one of its own here: every attempt at it (RQ's retry
    after a worker died, a job queued again) then samples the same tokens from the same
    logits, so the tokens a client already has from an earlier attempt are the start of
    the retry's answer, which the relay skips (`gateway.relay`). Without it, the client got
    one attempt's start joined to another attempt's rest.
    """
    sampling = sampling or SamplingParams()
    if sampling.seed is None and sampling.temperature > 0:
        sampling = sampling.model_copy(update={"seed": secrets.randbelow(2**32)})
    keys = prefix_namespace(model, chunk_size, tenant_salt).chain(tokens)
    return JobSpec(
        tokens=tokens,
        chain=[k.hex() for k in keys],
        chunk_size=chunk_size,
        model=model,
        tenant_salt=tenant_salt,
        sampling=sampling,
        enqueued_at=time.time() if enqueued_at is None else enqueued_at,
        wait_for_publish=wait_for_publish,
        route_key=None if route_key is None else xxhash.xxh3_64_hexdigest(f"{tenant_salt}\0{route_key}".encode()),
        message_starts=message_starts or [],
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_from_context: int
    cached_from_store: int
    evaluated_tokens: int


class Timings(BaseModel):
    queue_wait_s: float = 0.0
    lookup_s: float = 0.0
    fetch_s: float = 0.0
    restore_s: float = 0.0
    lease_wait_s: float = 0.0
    """Time spent waiting for another worker to publish a prefix of this prompt (`worker.cache.leases`)."""
    prompt_eval_s: float = 0.0
    first_token_s: float = 0.0
    total_s: float = 0.0


FinishReason = Literal["stop", "length", "cancelled"]
"""Why a choice ended: a stop (sequence, end of generation, grammar), max_tokens, or the job was cancelled."""
StoreStatus = Literal["ok", "unavailable", "disabled"]
"""Whether the worker could use the store for this job (``unavailable``: it evaluated cold, and says so)."""


class ChoiceResult(BaseModel):
    """A choice after the first (the first is `JobResult`'s own text, tokens and finish reason)."""

    index: int
    text: str
    finish_reason: FinishReason
    tokens: list[int]
    logprobs: list[float] | None = None


class JobResult(BaseModel):
    text: str
    finish_reason: FinishReason
    tokens: list[int]
    usage: Usage
    timings: Timings
    worker: str
    store_status: StoreStatus = "ok"
    restore_choice: str | None = Field(
        None,
        description="What the worker did with what the store held past its context (restore, partial, evaluate, unmeasured,"
        " small: `worker.cache.restore_choice.Choice`); None when the store held nothing more.",
    )
    stop_sequence: str | None = Field(None, description="The stop string that ended the first choice, if one did.")
    logprobs: list[float] | None = None
    extra_choices: list[ChoiceResult] = Field(default_factory=list, description="Choices 1..n-1 when n > 1.")
    prompt_logprobs: list[TokenEvent] | None = Field(None, description="Per prompt token (the first has no logprob), when asked for.")


class StartEvent(BaseModel):
    type: Literal["start"] = "start"
    attempt: int
    worker: str


class TokenEvent(BaseModel):
    type: Literal["token"] = "token"
    text: str
    token: int
    piece: str | None = Field(None, description="The token's own text; sent with logprobs.")
    logprob: float | None = None
    top_logprobs: dict[str, float] | None = None
    index: int = Field(0, description="The choice this token belongs to (n > 1).")


class DoneEvent(BaseModel):
    type: Literal["done"] = "done"
    result: JobResult


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    error: str
    retrying: bool = False


JobResult.model_rebuild()


def slot_names(name: str, parallel: int) -> list[str]:
    """The RQ worker names of a worker's sequences: its own name when it has one, ``name.0`` ... otherwise."""
    return [name] if parallel == 1 else [f"{name}.{i}" for i in range(parallel)]
