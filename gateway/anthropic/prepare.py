"""From a Messages request to one job: the chat pipeline's job, its breakpoints, and what the answer is measured against.

``max_tokens`` is required by Anthropic's API and often larger than a small context
(clients ask for 32,000): the job asks for what fits, and an answer that fills the
context ends with ``model_context_window_exceeded``, as Anthropic's does. A prompt that
alone fills the context is refused.

Breakpoints: each ``cache_control`` mark's cut request is rendered and tokenized; the
tokens it shares with the whole prompt are the prefix to keep. The worker publishes it at
once and pins it in the store for the mark's TTL (`worker.protocol.Breakpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from gateway.anthropic.convert import Converted, chat_request, convert, in_messages_terms
from gateway.anthropic.schemas import CountTokensRequest, MessagesRequest
from gateway.errors import InvalidRequest
from gateway.prepare import Prepared, Preparer
from gateway.tenants import Tenant
from store.tails import common_prefix
from worker.protocol import Breakpoint, JobResult


@dataclass(frozen=True)
class MessageJob:
    prepared: Prepared
    asked_tokens: int
    """``max_tokens`` as the client asked (the job may ask for less: what fits)."""
    stop_sequences: tuple[str, ...]

    @property
    def breakpoints(self) -> list[Breakpoint]:
        return self.prepared.spec.breakpoints


def prepare_message(preparer: Preparer, req: MessagesRequest, tenant: Tenant) -> MessageJob:
    preparer.check_model(req.model)
    conv = convert(req)
    chat = chat_request(req, conv.messages)
    tokens = preparer.chat_tokens(chat, conv.prefill)
    n_ctx = preparer.settings.n_ctx
    if len(tokens) >= n_ctx:
        raise InvalidRequest(
            f"prompt is too long: {len(tokens)} tokens > {n_ctx - 1} maximum (this model's context holds {n_ctx})", param="messages"
        )
    chat.max_tokens = min(req.max_tokens, n_ctx - len(tokens))
    try:
        prepared = preparer.chat(chat, tenant, prefill=conv.prefill)
    except InvalidRequest as e:
        raise in_messages_terms(e) from None
    spec = prepared.spec.model_copy(update={"breakpoints": breakpoints(preparer, req, conv, tokens)})
    return MessageJob(replace(prepared, spec=spec), req.max_tokens, tuple(s for s in req.stop_sequences or [] if s))


def count_tokens(preparer: Preparer, req: CountTokensRequest) -> int:
    preparer.check_model(req.model)
    conv = convert(req)
    return len(preparer.chat_tokens(chat_request(req, conv.messages), conv.prefill))


def breakpoints(preparer: Preparer, req: CountTokensRequest, conv: Converted, tokens: list[int]) -> list[Breakpoint]:
    """Where each mark falls in the prompt's tokens, with its TTL (the longest, where two fall together)."""
    ttl: dict[int, int] = {}
    whole = np.asarray(tokens, dtype=np.int64)
    for mark in conv.marks:
        try:
            cut = preparer.chat_tokens(chat_request(req, mark.messages, mark.tools))
        except InvalidRequest:
            continue  # the template cannot render the request cut there (no user turn yet, say): nothing to keep
        n = common_prefix(whole, cut)
        if n:
            ttl[n] = max(ttl.get(n, 0), mark.ttl_s)
    return [Breakpoint(tokens=n, ttl_s=t) for n, t in sorted(ttl.items())]


def usage(result: JobResult, job: MessageJob) -> dict[str, object]:
    """Anthropic's usage: tokens read from a cache (a worker's context or the store), written at a breakpoint, and the rest.

    A breakpoint's tokens that were not read from a cache were evaluated and published
    for it (when the store is up); they count as written, under the breakpoint's TTL.
    """
    u = result.usage
    read = u.cached_tokens
    written = {300: 0, 3600: 0}
    at = read
    for b in job.breakpoints if result.store_status == "ok" else []:
        if b.tokens > at:
            written[3600 if b.ttl_s >= 3600 else 300] += b.tokens - at
            at = b.tokens
    return {
        "input_tokens": u.prompt_tokens - read - sum(written.values()),
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": sum(written.values()),
        "cache_read_input_tokens": read,
        "cache_creation": {"ephemeral_5m_input_tokens": written[300], "ephemeral_1h_input_tokens": written[3600]},
    }


def stop_reason(result: JobResult, job: MessageJob, called: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``."""
    if result.finish_reason == "length":  # a call the cut fell in is no call to run
        fits = job.prepared.spec.sampling.max_tokens
        return ("model_context_window_exceeded" if fits < job.asked_tokens else "max_tokens"), None
    if called:
        return "tool_use", None
    if result.stop_sequence is not None and result.stop_sequence in job.stop_sequences:
        return "stop_sequence", result.stop_sequence
    return "end_turn", None
