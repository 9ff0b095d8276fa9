"""Every error the API answers with, and the one place that maps them to HTTP status codes and OpenAI's error shape."""

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
