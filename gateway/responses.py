"""OpenAI response bodies (whole and streamed) built from a job's token events and result."""

from __future__ import annotations

import time
from typing import Any

from worker.protocol import JobResult, TokenEvent

FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


def usage(result: JobResult) -> dict[str, Any]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def kvpool_extra(result: JobResult) -> dict[str, Any]:
    """kvpool's own details, beside OpenAI's fields: who answered, where the cached tokens came from, timings."""
    return {
        "worker": result.worker,
        "cached_from_context": result.usage.cached_from_context,
        "cached_from_store": result.usage.cached_from_store,
        "evaluated_tokens": result.usage.evaluated_tokens,
        "store": result.store_status,
        "timings": result.timings.model_dump(),
    }


def _completion_logprobs(tokens: list[TokenEvent]) -> dict[str, Any]:
    scored = [t for t in tokens if t.logprob is not None]
    offsets, at = [], 0
    for t in scored:
        offsets.append(at)
        at += len(t.piece or "")
    return {
        "tokens": [t.piece or "" for t in scored],
        "token_logprobs": [t.logprob for t in scored],
        "top_logprobs": [t.top_logprobs or {} for t in scored],
        "text_offset": offsets,
    }


def _chat_logprobs(tokens: list[TokenEvent]) -> dict[str, Any]:
    def entry(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t.piece or "", t.logprob), "top_logprobs": [entry(k, v) for k, v in (t.top_logprobs or {}).items()]}
            for t in tokens
            if t.logprob is not None
        ]
    }


def completion_body(job_id: str, model: str, result: JobResult, tokens: list[TokenEvent], want_logprobs: bool) -> dict[str, Any]:
    return {
        "id": f"cmpl-{job_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": result.text,
                "finish_reason": FINISH[result.finish_reason],
                "logprobs": _completion_logprobs(tokens) if want_logprobs else None,
            }
        ],
        "usage": usage(result),
        "kvpool": kvpool_extra(result),
    }


def chat_body(job_id: str, model: str, result: JobResult, tokens: list[TokenEvent], want_logprobs: bool) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{job_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": FINISH[result.finish_reason],
                "logprobs": _chat_logprobs(tokens) if want_logprobs else None,
            }
        ],
        "usage": usage(result),
        "kvpool": kvpool_extra(result),
    }


class StreamChunks:
    """The ``data:`` objects of a streamed response, in order."""

    def __init__(self, job_id: str, model: str, chat: bool, want_logprobs: bool) -> None:
        self.id = f"chatcmpl-{job_id}" if chat else f"cmpl-{job_id}"
        self.model = model
        self.chat = chat
        self.want_logprobs = want_logprobs
        self.created = int(time.time())

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def first(self) -> dict[str, Any] | None:
        if not self.chat:
            return None
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])

    def token(self, t: TokenEvent) -> dict[str, Any] | None:
        if not t.text and not (self.want_logprobs and t.logprob is not None):
            return None
        if self.chat:
            lp = _chat_logprobs([t]) if self.want_logprobs else None
            return self._chunk([{"index": 0, "delta": {"content": t.text}, "logprobs": lp, "finish_reason": None}])
        lp = _completion_logprobs([t]) if self.want_logprobs else None
        return self._chunk([{"index": 0, "text": t.text, "logprobs": lp, "finish_reason": None}])

    def last(self, result: JobResult) -> dict[str, Any]:
        reason = FINISH[result.finish_reason]
        if self.chat:
            return self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}])
        return self._chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": reason}])

    def usage(self, result: JobResult) -> dict[str, Any]:
        return self._chunk([], usage=usage(result), kvpool=kvpool_extra(result))
