"""The rounds of the engine loop: which tokens of which sequences go into each ``llama_decode`` call.

Pure planning, no llama.cpp call: `plan_round` takes the decode requests waiting and
returns the calls of one round; `call_kinds` names each call by what it holds.

Each round takes

* one step of every sequence that is generating (a generated token and, in ``pair``
  mode, the token before it), in one call, and
* a piece of at most one prompt still being evaluated (``KVPOOL_PREFILL_CHUNK`` tokens
  while others generate, a whole ``n_ubatch`` when none does), so a long prompt never
  holds the other sequences' next tokens for longer than one piece.

**Exactness.** A token's bits must not depend on what else is in the batch. llama.cpp's
CPU kernels compute each row of a weight product alone, whatever the other rows, and
each sequence attends only over its own stream; what they do not give is the same bits
for a *single* query row of a sequence (``worker.decoding``). llama.cpp cuts a
multi-stream batch into micro-batches that take the same number of tokens from each
sequence (``split_equal``), so the rounds are built such that no sequence ever gets a
one-token piece: every step in one call has the same size k, a prompt piece joins that
call only when it is at least k + 2 tokens, a piece never leaves a lone last token
behind (`worker.llama_state.batch_sizes`' rule), and steps of one token (``single`` or
``settle`` mode) never share a call with a prompt: beside them ``split_equal`` would cut
the prompt into one-token micro-batches, each computed as a single row. The start-up
checks and ``tests/worker/test_batched.py`` compare every case with a cold evaluation bit
for bit.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np


@dataclass(eq=False)
class Request:
    """Tokens of one sequence to decode after ``pos`` cells; ``rows``: the logits of every token, else of the last."""

    seq: int
    tokens: list[int]
    pos: int
    rows: bool = False
    done: int = 0
    out: np.ndarray | None = None
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False
    """Its job stopped waiting (cancelled, timed out, stopped): the loop drops it before the next round."""

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done

    @property
    def is_step(self) -> bool:
        """A generated token (and its predecessor): decoded with the other sequences' steps."""
        return len(self.tokens) <= 2 and not self.rows


Piece = tuple[Request, int]
"""A request and how many of its next tokens go into a call."""


class CallKind(StrEnum):
    """What one ``llama_decode`` of a round holds."""

    STEPS = "steps"
    """Generated tokens only, in a round without a prompt."""
    STEPS_BESIDE_PROMPT = "steps_beside_prompt"
    """Generated tokens only, while a prompt piece goes in another call of the round (one-token steps never share a call with one)."""
    PROMPT = "prompt"
    """A prompt piece alone."""
    MIXED = "mixed"
    """Steps and a prompt piece in one call."""


@dataclass
class CallTotals:
    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.calls += 1
        self.tokens += tokens
        self.seconds += seconds

    def fields(self) -> dict[str, int | float]:
        return {"calls": self.calls, "tokens": self.tokens, "s": round(self.seconds, 3)}


def call_kinds(calls: list[list[Piece]]) -> list[CallKind]:
    """The kind of each call of a round."""
    prompt_in_round = any(not r.is_step for call in calls for r, _ in call)
    kinds = []
    for call in calls:
        steps = [r.is_step for r, _ in call]
        if all(steps):
            kinds.append(CallKind.STEPS_BESIDE_PROMPT if prompt_in_round else CallKind.STEPS)
        else:
            kinds.append(CallKind.PROMPT if not any(steps) else CallKind.MIXED)
    return kinds


def plan_round(queue: list[Request], n_ubatch: int, prefill_chunk: int) -> list[list[Piece]]:
    """The calls of one round: the steps, grouped by size, and a piece of the oldest prompt (see the module's doc)."""
    steps = [r for r in queue if r.is_step]
    prompts = [r for r in queue if not r.is_step]
    calls: list[list[Piece]] = []
    by_size: dict[int, list[Piece]] = {}
    for r in steps:
        by_size.setdefault(r.left, []).append((r, r.left))
    for size in sorted(by_size):
        group = sorted(by_size[size], key=lambda p: p[0].seq)
        for lo in range(0, len(group), max(1, n_ubatch // size)):
            calls.append(group[lo : lo + n_ubatch // size])
    if prompts:
        prompt = prompts[0]
        k = max(by_size) if by_size else 0
        budget = min(prefill_chunk, n_ubatch) if steps else n_ubatch  # a call holds n_ubatch tokens at most
        n = prompt_piece(prompt.left, budget)
        shared = next((c for c in calls if c[0][1] == k and k >= 2 and n >= k + 2 and sum(m for _, m in c) + n <= n_ubatch), None)
        if shared is not None:
            shared.append((prompt, n))
            shared.sort(key=lambda p: p[0].seq)
        else:
            calls.append([(prompt, n)])
    return calls


def prompt_piece(left: int, budget: int) -> int:
    """How many of a prompt's ``left`` tokens go in this round: at most ``budget``, never leaving one token alone."""
    n = min(left, budget)
    if left - n == 1:
        n -= 1
    return n
