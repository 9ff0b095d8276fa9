"""Answering one ``POST /v1/responses``: the job relayed into output items, as one body or as the Responses API's events.

Events of a streamed response, each with its ``sequence_number``, as OpenAI sends them:
``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, and for a function call
``response.function_call_arguments.delta`` and ``.done``; then
``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut the answer). A failure mid-stream is an ``error`` event and
``response.failed``. With ``store`` the response is stored before its last event is sent,
so a client may name it in its next request at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
import redis
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from gateway.answer import Submitted, cancel_unfinished
from gateway.errors import APIError, Overloaded, WorkerFailed
from gateway.relay import relay_reads
from gateway.responses import kvpool_extra
from gateway.responses_api.items import OutputBuilder, new_id
from gateway.responses_api.prepare import Turn
from gateway.responses_api.schemas import ResponseCreate
from gateway.responses_api.state import ResponseState, Stored
from gateway.state import Gateway
from gateway.tenants import Tenant
from worker.protocol import JobResult, TokenEvent

log = logging.getLogger("kvpool.gateway")


def usage(result: JobResult) -> dict[str, Any]:
    u = result.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def response_object(rid: str, created: int, req: ResponseCreate, model: str, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's Response object, without usage."""
    fmt = req.text.format if req.text and req.text.format else None
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": [{"description": None, "parameters": None, "strict": None, **t} for t in req.tools or []],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


class Run:
    def __init__(self, gw: Gateway, state: ResponseState, req: ResponseCreate, turn: Turn, tenant: Tenant) -> None:
        self.gw = gw
        self.state = state
        self.req = req
        self.turn = turn
        self.tenant = tenant
        self.id = new_id("resp")
        self.created = int(time.time())
        self.output = OutputBuilder(turn.tools, turn.namespaces)

    def body(self, status: str = "in_progress") -> dict[str, Any]:
        return response_object(self.id, self.created, self.req, self.gw.preparer.model_name, status, self.output.items)

    async def _finish(self, result: JobResult) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The answer's last events and its final body, stored (when asked) before either is sent."""
        status = "incomplete" if result.finish_reason == "length" else "completed"
        events = self.output.finish(status)
        extra = {**kvpool_extra(result), "continued_tokens": self.turn.continued, "tools_left_out": self.turn.left_out}
        body = {**self.body(status), "usage": usage(result), "kvpool": extra}
        if self.req.store:
            spec = self.turn.prepared.spec
            stored = Stored(body, self.turn.items, spec.tokens + result.tokens, len(spec.tokens), self.turn.render_key)
            dropped = await run_in_threadpool(self.state.put, self.tenant, stored)
            if dropped:
                log.info("responses.dropped", extra={"tenant": self.tenant.id, "responses": dropped, "reason": "byte budget"})
        return body, events

    async def _events(self, request: Request, job: Submitted) -> AsyncGenerator[list[TokenEvent] | JobResult]:
        """The job's new tokens of each read of its stream (`relay_reads`), then its result."""
        async with contextlib.aclosing(relay_reads(self.gw.relay_context(request, job.prepared, job.job_id, job.t0, "responses"))) as reads:
            async for got in reads:
                if isinstance(got, JobResult):
                    job.done = True
                yield got

    async def whole(self, request: Request, job: Submitted) -> dict[str, Any]:
        result = None
        try:
            async for got in self._events(request, job):
                if isinstance(got, JobResult):
                    result = got
                else:
                    for t in got:
                        self.output.push(t.text)
        finally:
            await cancel_unfinished(self.gw, [job])
        if result is None:
            raise WorkerFailed("the job ended without a result")
        body, _ = await self._finish(result)
        return body

    async def sse(self, request: Request, job: Submitted) -> AsyncIterator[bytes]:
        seq = 0

        def event(ev: dict[str, Any]) -> bytes:
            nonlocal seq
            seq += 1
            return f"event: {ev['type']}\ndata: {json.dumps({**ev, 'sequence_number': seq - 1})}\n\n".encode()

        yield event({"type": "response.created", "response": self.body()})
        yield event({"type": "response.in_progress", "response": self.body()})
        events = self._events(request, job)
        try:
            async for got in events:
                if not isinstance(got, JobResult):
                    if frames := b"".join(event(e) for t in got for e in self.output.push(t.text)):
                        yield frames  # the tokens of one read in one write to the socket
                    continue
                body, last = await self._finish(got)
                yield b"".join([*(event(e) for e in last), event({"type": f"response.{body['status']}", "response": body})])
        except (APIError, redis.RedisError) as e:
            err = e if isinstance(e, APIError) else Overloaded(f"the job queue (Redis) was lost mid-stream: {type(e).__name__}")
            log.warning("stream.failed", extra={"job": job.job_id, "status": err.status, "reason": err.message})
            yield event({"type": "error", "code": err.code or err.type, "message": err.message, "param": err.param})
            failed = {**self.body("failed"), "error": {"code": err.code or err.type, "message": err.message}}
            yield event({"type": "response.failed", "response": failed})
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()
            await cancel_unfinished(self.gw, [job])
