"""The fallback where generated tokens cannot be decoded exactly: evaluate the completion again as prompt, at idle time.

On a build or layout where `worker.engine.decoding.choose_mode` finds no exact mode (a GPU
backend, f16 with a stock build's flash attention), decoded cells are not what a cold evaluation of the
next turn's prompt would hold. Evaluated again in prompt batches they are, and then serve
the next turn of the chat exactly, from this context and, published, from any worker.
It is idle-time work: it starts only after the worker has had no job waiting for
``idle_s``, and it stops between batches as soon as one arrives (that job evaluates
whatever it needs itself).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from worker.engine.llama_state import Llama, batch_sizes, evaluate_prompt

SETTLE_BATCH = 32
"""Tokens per settle batch: the longest a job that arrives meanwhile waits."""


def settle(
    llm: Llama, tokens: list[int], generated: list[int], *, n_ctx: int, idle_s: float, job_waiting: Callable[[], bool]
) -> Iterator[int]:
    """Evaluates ``tokens + generated`` from the end of the prompt on; yields how many leading cells are exact after each batch."""
    held = tokens + generated
    if not generated or len(held) > n_ctx or not idle_for(idle_s, job_waiting):
        return
    pos = min(len(tokens), len(held) - 2)
    for size in batch_sizes(len(held) - pos, SETTLE_BATCH):
        if pos > len(tokens) and job_waiting():
            return
        evaluate_prompt(llm, held[: pos + size], pos)
        pos += size
        yield pos


def idle_for(seconds: float, job_waiting: Callable[[], bool]) -> bool:
    """True once ``seconds`` pass with no job waiting; False as soon as one is."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if job_waiting():
            return False
        time.sleep(0.01)
    return not job_waiting()
