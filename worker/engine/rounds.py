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
for a *single* query row of a sequence (``worker.engine.decoding``). llama.cpp cuts a
multi-stream batch into micro-batches that take the same number of tokens from each
sequence (``split_equal``), so the rounds are built such that no sequence ever gets a
one-token piece: every step in one call has the same size k, a prompt piece joins that
call only when it is at least k + 2 tokens, a piece never leaves a lone last token
behind (`worker.engine.llama_state.batch_sizes`' rule), and steps of one token (``single`` or
``settle`` mode) never share a call with a prompt: ``split_equal`` would put the prompt's
first token in the steps' micro-batch as a single row. The start-up
checks and ``tests/worker/test_batched.py`` compare every case with a cold evaluation bit
for bit.

**Fillers.** With a KV stream per sequence, llama.cpp cuts a batch into micro-batches of
*consecutive* sequence ids (``split_equal`` with ``sequential``), and each micro-batch
reads the weights once. Steps of sequences 0 and 2 are two micro-batches; with a filler
token in idle sequence 1 (decoded at its end and removed at once, so its cells and their
places are as before) they are one. Whether the extra row costs less than the second
pass over the weights depends on the model: measured at start-up (`StepCost`), a filler
pays on the 1.1B f16 bench model (3 rows in one micro-batch 69 ms against 117 ms for two
of one) and not on SmolLM2 (17 against 13 ms) (``docs/bench/rounds-2026-12-06/fillers-*.txt``).
A prompt piece gains nothing from sharing a call with steps: its tokens go in
micro-batches of their own whatever the call (measured, same page), so `plan_round`
shares a call only where the sizes allow it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import groupby

import numpy as np

Advance = Callable[["Request"], "tuple[list[int], int] | None"]
"""Run by the loop after a chained step (`Chain`): the next step's tokens and position, or None when the generation is done."""


@dataclass(eq=False)
class Chain:
    """A generation whose steps follow each other on the loop's thread, without waking its job.

    After each step the loop calls ``advance`` with the step's request (its logits in
    ``out``): it samples, sends the token, and names the next step, which the loop queues
    for the next round at once. The job's thread waits on ``finished`` alone: set when
    ``advance`` says done, on an error (``error``) or, once ``abandoned``, when the loop has
    let go of it (it then touches neither the sequence's cells nor its records).
    """

    advance: Advance
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    abandoned: bool = False


@dataclass(eq=False)
class Request:
    """Tokens of one sequence to decode after ``pos`` cells; ``rows``: the logits of every token, else of the last.

    A step of a `Chain` names it: the loop then advances the chain instead of waking a job.
    """

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
    chain: Chain | None = None
    record: Callable[[Request], None] | None = None
    """Run by the loop once the request's last token is decoded, before its job wakes: the sequence's records change with its cells."""

    @property
    def dropped(self) -> bool:
        """Abandoned, itself or through its chain."""
        return self.abandoned or (self.chain is not None and self.chain.abandoned)

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


StepCost = Sequence[float]
"""Seconds of one call of steps held by r consecutive sequences in one micro-batch, at index r - 1 (measured at start-up)."""


def fillers(seqs: list[int], cost: StepCost | None) -> list[int]:
    """The idle sequences to give a filler token, so that the steps of ``seqs`` go in one micro-batch; [] where that costs more.

    ``seqs`` are the sequences whose steps one call holds. Without fillers each run of
    consecutive ids is a micro-batch of its own; with them the span from the first to the
    last is one (see the module's doc).
    """
    if not cost or len(seqs) < 2:
        return []
    order = sorted(seqs)
    span = order[-1] - order[0] + 1
    if span == len(order) or span > len(cost):
        return []
    runs = [len(list(run)) for _, run in groupby(enumerate(order), key=lambda e: e[1] - e[0])]
    held = set(order)
    return [s for s in range(order[0], order[-1] + 1) if s not in held] if cost[span - 1] < sum(cost[r - 1] for r in runs) else []
