"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) over the chat pipeline.

``schemas`` (request bodies), ``convert`` (to chat messages, and where ``cache_control``
marks fall), ``prepare`` (the job, its breakpoints, usage), ``events`` (the message and its
stream), ``errors`` (Anthropic's error shape), ``router`` (the routes).
"""

from gateway.anthropic.errors import error_body, error_status
from gateway.anthropic.router import messages_router

__all__ = ["error_body", "error_status", "messages_router"]
