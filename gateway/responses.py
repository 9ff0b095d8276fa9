"""OpenAI response bodies (whole and streamed) built from a job's token events and result."""

from __future__ import annotations

import time
from typing import Any

from gateway.toolformat import Offered
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


def _completion_logprobs(tokens: list[TokenEvent], start: int = 0) -> dict[str, Any]:
    """Tokens with a piece: generated ones scored, and echoed prompt tokens (the first of which has no logprob)."""
    scored = [t for t in tokens if t.piece is not None and (t.logprob is not None or t.token >= 0)]
    offsets, at = [], start
    for t in scored:
        offsets.append(at)
        at += len(t.piece or "")
    return {
        "tokens": [t.piece or "" for t in scored],
        "token_logprobs": [t.logprob for t in scored],
        "top_logprobs": [None if t.logprob is None else (t.top_logprobs or {}) for t in scored],
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


def _choices(result: JobResult) -> list[tuple[int, str, str]]:
    """(index, text, finish reason) of every choice the job sampled."""
    first = (0, result.text, FINISH[result.finish_reason])
    return [first, *((c.index, c.text, FINISH[c.finish_reason]) for c in result.extra_choices)]


def _of(tokens: list[TokenEvent], index: int) -> list[TokenEvent]:
    return [t for t in tokens if t.index == index]


def completion_body(
    job_id: str, model: str, result: JobResult, tokens: list[TokenEvent], want_logprobs: bool, *, echo: str | None = None, offset: int = 0
) -> dict[str, Any]:
    """``echo``: the prompt's text, put before each choice's (with the prompt's logprobs when the job scored it)."""
    prompt = (result.prompt_logprobs or []) if echo is not None else []
    return {
        "id": f"cmpl-{job_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": offset + i,
                "text": (echo or "") + text,
                "finish_reason": finish,
                "logprobs": _completion_logprobs(prompt + _of(tokens, i)) if want_logprobs else None,
            }
            for i, text, finish in _choices(result)
        ],
        "usage": usage(result),
        "kvpool": kvpool_extra(result),
    }


def _message(text: str, finish: str, tools: Offered | None) -> tuple[dict[str, Any], str]:
    if not tools:
        return {"role": "assistant", "content": text}, finish
    content, calls = tools.parse(text)
    if not calls:
        return {"role": "assistant", "content": content}, finish
    return {"role": "assistant", "content": content, "tool_calls": calls}, "length" if finish == "length" else "tool_calls"


def chat_body(
    job_id: str, model: str, result: JobResult, tokens: list[TokenEvent], want_logprobs: bool, *, tools: Offered | None = None
) -> dict[str, Any]:
    """``tools``: the functions the answer may call; its text is parsed for their calls."""
    choices = []
    for i, text, finish in _choices(result):
        message, reason = _message(text, finish, tools)
        choices.append(
            {"index": i, "message": message, "finish_reason": reason, "logprobs": _chat_logprobs(_of(tokens, i)) if want_logprobs else None}
        )
    return {
        "id": f"chatcmpl-{job_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(result),
        "kvpool": kvpool_extra(result),
    }


class StreamChunks:
    """The ``data:`` objects of a streamed response, in order."""

    def __init__(
        self,
        job_id: str,
        model: str,
        chat: bool,
        want_logprobs: bool,
        n: int = 1,
        *,
        offset: int = 0,
        echo: str | None = None,
        tools: Offered | None = None,
    ) -> None:
        self.id = f"chatcmpl-{job_id}" if chat else f"cmpl-{job_id}"
        self.model = model
        self.chat = chat
        self.want_logprobs = want_logprobs
        self.n = n
        self.offset = offset
        self.echo = echo
        self.tool_streams = {i: tools.stream() for i in range(n)} if tools else None
        self.created = int(time.time())

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def first(self) -> dict[str, Any] | None:
        if not self.chat:
            if not self.echo:
                return None
            return self._chunk(
                [{"index": self.offset + i, "text": self.echo, "logprobs": None, "finish_reason": None} for i in range(self.n)]
            )
        return self._chunk(
            [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None} for i in range(self.n)]
        )

    def token(self, t: TokenEvent) -> list[dict[str, Any]]:
        if not t.text and not (self.want_logprobs and t.logprob is not None):
            return []
        if self.chat:
            lp = _chat_logprobs([t]) if self.want_logprobs else None
            if self.tool_streams is None:
                return [self._chunk([{"index": t.index, "delta": {"content": t.text}, "logprobs": lp, "finish_reason": None}])]
            return [
                self._chunk([{"index": t.index, "delta": d, "logprobs": None, "finish_reason": None}])
                for d in self.tool_streams[t.index].push(t.text)
            ]
        lp = _completion_logprobs([t]) if self.want_logprobs else None
        return [self._chunk([{"index": self.offset + t.index, "text": t.text, "logprobs": lp, "finish_reason": None}])]

    def last(self, result: JobResult) -> list[dict[str, Any]]:
        if not self.chat:
            return [
                self._chunk([{"index": self.offset + i, "text": "", "logprobs": None, "finish_reason": f} for i, _, f in _choices(result)])
            ]
        out = []
        finishes = []
        for i, _, f in _choices(result):
            stream = self.tool_streams[i] if self.tool_streams else None
            if stream is not None:
                out += [self._chunk([{"index": i, "delta": d, "logprobs": None, "finish_reason": None}]) for d in stream.flush()]
            finishes.append(
                {
                    "index": i,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": "tool_calls" if stream is not None and stream.calls and f != "length" else f,
                }
            )
        return [*out, self._chunk(finishes)]

    def usage(self, results: list[JobResult]) -> dict[str, Any]:
        return self._chunk([], usage=sum_usage([usage(r) for r in results]), kvpool=merged_extra(results))


def sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage of several jobs (one request with several prompts)."""
    total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {**total, "prompt_tokens_details": {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)}}


def merged_extra(results: list[JobResult]) -> dict[str, Any]:
    """kvpool's details for one job, or for several prompts: one entry per prompt under ``prompts``."""
    if len(results) == 1:
        return kvpool_extra(results[0])
    return {"prompts": [kvpool_extra(r) for r in results]}
