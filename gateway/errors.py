"""Every error the API answers with, and the one place that maps them to HTTP status codes and OpenAI's error shape::

    APIError (500 server_error)
    ├── InvalidRequest (400)        the client's mistake, naming the field
    │   └── ContextOverflow (400)   prompt plus max_tokens beyond the context
    ├── Unauthorized (401)
    ├── NotFound (404)              a model, file or batch this tenant does not have
    ├── Conflict (409)              an Idempotency-Key sent again with another body
    ├── PayloadTooLarge (413)
    ├── Overloaded (503)            queue full, no (matching) worker, Redis away: retry later
    ├── WorkerFailed (502)          the worker gave up on the job, with its reason
    └── Timeout (504)

The app's exception handlers (`gateway.app`) turn these, a validation error, a Redis
error and anything unexpected into OpenAI's error body; nothing else writes one.
"""

from __future__ import annotations

from typing import Any


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
    def __init__(self, prompt_tokens: int, max_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"this model's context holds {n_ctx} tokens, but the request asks for {prompt_tokens + max_tokens} "
            f"({prompt_tokens} in the prompt + {max_tokens} for the completion); shorten the prompt or lower max_tokens",
            param="max_tokens",
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
