"""Every error the API answers with, and the one mapping from lower layers' exceptions to them::

    APIError (500 server_error)
    ├── InvalidRequest (400)        the client's mistake, naming the field
    │   ├── ContextOverflow (400)   a prompt that fills the context alone
    │   ├── TemplateError (400)     the chat template refuses these messages (`gateway.tokenizer`)
    │   └── SchemaError (400)       a JSON Schema a grammar cannot enforce, naming where (`gateway.structured`)
    ├── Unauthorized (401)
    ├── NotFound (404)              a model, file or batch this tenant does not have
    ├── Conflict (409)              an Idempotency-Key sent again with another body
    ├── PayloadTooLarge (413)
    ├── Overloaded (503)            queue full, no (matching) worker, Redis or the store away: retry later
    ├── WorkerFailed (502)          the worker gave up on the job, with its reason
    └── Timeout (504)

`to_api_error` is the one mapping from what lower layers raise, as httpx's
``map_exceptions`` does for transports; `map_exceptions` applies it to a block:

    pydantic ValidationError        InvalidRequest ``<field path>: <pydantic's message>``, param the top-level field
    FastAPI RequestValidationError  the same (its leading ``body``/``query``/``path`` location dropped)
    store.errors.StoreUnavailable   Overloaded ``store_unavailable``, Retry-After
    redis.RedisError                Overloaded ``queue_unavailable``, Retry-After
    anything else                   APIError ``internal error: <type>``, ``internal_error`` (500)

So a bad body gets the same message and param over HTTP (`gateway.app`'s exception
handlers) and as a Batch API result line (`gateway.batch.plan`), and the Files API
(`gateway.batch.files`) answers a store outage as HTTP does. A pydantic ValidationError is
the client's only where the client's input is being validated: map it there, not around
code that parses the pool's own data (there it is a bug, and a 500).

Not API errors, but control flow that never leaves its module: `gateway.batch.runner.BatchAborted`,
`gateway.batch.service.Cancelled`, `gateway.batch.cli._Interrupted`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from store.errors import StoreUnavailable

RETRY_AFTER_S = 5
"""What a 503 for a lost dependency (Redis, the store) tells the client to wait."""
REQUEST_PARTS = ("body", "query", "path", "header", "cookie")
"""The first element of a FastAPI validation error's location: where in the request, not which field."""


class APIError(Exception):
    status = 500
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"


class ContextOverflow(InvalidRequest):
    def __init__(self, prompt_tokens: int, n_ctx: int, param: str) -> None:
        super().__init__(
            f"this model's context holds {n_ctx} tokens, but the prompt alone is {prompt_tokens}, which leaves no room for "
            f"the completion; shorten the prompt",
            param=param,
            code="context_length_exceeded",
        )


class Unauthorized(APIError):
    status = 401
    type = "authentication_error"


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"


class Conflict(APIError):
    status = 409
    type = "invalid_request_error"


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"


class Overloaded(APIError):
    status = 503
    type = "server_error"


class WorkerFailed(APIError):
    status = 502
    type = "server_error"


class Timeout(APIError):
    status = 504
    type = "server_error"


MAPPED: tuple[type[Exception], ...] = (ValidationError, RequestValidationError, StoreUnavailable, redis.RedisError)
"""The lower layers' exceptions `map_exceptions` translates; an APIError, or anything else, passes as it is."""


def to_api_error(exc: BaseException) -> APIError:
    """The API error ``exc`` stands for: itself if it is one, the mapping in the module docstring otherwise."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return invalid_input(exc.errors(), request=True)
    if isinstance(exc, ValidationError):
        return invalid_input(exc.errors())
    if isinstance(exc, StoreUnavailable):
        return Overloaded(
            f"the store is unreachable ({exc.endpoint}): {exc.reason}",
            code="store_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, redis.RedisError):
        return Overloaded(
            f"the job queue (Redis) is unreachable: {type(exc).__name__}",
            code="queue_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    return internal_error(exc)


def internal_error(exc: BaseException) -> APIError:
    """A 500 naming only the exception's type: its message may hold what a client must not see."""
    return APIError(f"internal error: {type(exc).__name__}", code="internal_error")


@contextmanager
def map_exceptions() -> Iterator[None]:
    """Raise what the block raises from `MAPPED` as its API error (chained to it); anything else passes unchanged."""
    try:
        yield
    except MAPPED as e:
        raise to_api_error(e) from e


def invalid_input(errors: Sequence[Any], *, request: bool = False) -> InvalidRequest:
    """pydantic's first error as OpenAI-style clients show it: ``messages.0.content: <why>``, param ``messages``.

    ``request``: the errors are FastAPI's, whose locations start with the part of the request
    (``body``, ``query``, ...), dropped here so that a body validated over HTTP and one
    validated from a batch line name the same field in the same words.
    """
    err = errors[0] if errors else {}
    if err.get("type") == "json_invalid":
        return InvalidRequest("the request body is not valid JSON")
    loc = [str(p) for p in err.get("loc", ())]
    if request and loc and loc[0] in REQUEST_PARTS:
        loc = loc[1:]
    where = ".".join(loc)
    msg = err.get("msg", "invalid request")
    return InvalidRequest(f"{where}: {msg}" if where else msg, param=loc[0] if loc else None)
