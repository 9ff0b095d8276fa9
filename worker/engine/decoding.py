"""How generated tokens are decoded, so that their cells hold what a cold evaluation would.

A prompt is evaluated in batches of two or more tokens (`worker.engine.llama_state.batch_sizes`),
and llama.cpp's CPU kernels give every token the same bits for any such split. A
generated token, though, is decoded in a batch of its own, and whether a one-token batch
gives the same bits depends on the build: llamafile's sgemm (``GGML_LLAMAFILE``, on in
the default build) computes the matrix products of batches of two or more rows and
refuses a single row, which ggml's own kernels then compute in another order. Attention
has one query row per generated token, so on such a build a decoded token's cells and
the logits that follow differ in the last bits from a batched evaluation of the same
tokens. Three ways to decode, chosen at start-up by measuring them on the loaded model
(`choose_mode`):

* `DecodeMode.SINGLE`: one token per step. Exact where one-token batches use the same
  kernels as larger ones: a build with ``GGML_LLAMAFILE=OFF``, or one whose sgemm takes
  single rows of float matrices too, which ``deploy/setup.sh`` builds (``deploy/patches/``;
  the builds are measured in `docs/bench/exact-decoding.md`). llama-cpp-python's stock wheel gets `PAIR`.
* `DecodeMode.PAIR`: each step drops the previous token's cell and decodes that token
  again together with the new one, a two-token batch, so every cell comes from the
  batched kernels: exact wherever prompt batches are, at the price of a second token
  per step.
* `DecodeMode.SETTLE`: neither is exact (a GPU backend, f16 with a stock build's flash attention, a
  forced mode that failed its check). Generated cells are never reused or published as
  they are; the worker evaluates the completion again as prompt once the worker idles
  (`settle`, run by `worker.answering.Engine.settle`), as every engine before exact decoding
  did: evaluated again in prompt batches the cells are a cold evaluation's, and serve the
  next turn of the chat exactly, from this context and, published, from any worker. It is
  idle-time work: it starts only after no job has waited for ``idle_s``, and stops between
  batches as soon as one arrives (that job evaluates whatever it needs itself).

In the exact modes the answer itself is what a cold evaluation of the prompt plus the
tokens so far gives at every step, so it is the same bits on every exact worker of a
kernel fingerprint, and the context holds the cold cells of the prompt and of every
answer token but the last (sampled, never decoded: `answer_held`): the next turn of a
chat resumes there, here or, published, anywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from worker.engine.llama_state import Llama, batch_sizes, evaluate_prompt, last_logits

CHECK_SEGMENTS = ((24, 10), (16, 10), (16, 10))  # (prompt tokens evaluated, answer tokens decoded), one after another
Probe = list[tuple[list[int], list[int]]]


class DecodeMode(StrEnum):
    SINGLE = "single"
    PAIR = "pair"
    SETTLE = "settle"

    @property
    def exact(self) -> bool:
        """Decoded cells are what a cold evaluation of the same tokens holds."""
        return self is not DecodeMode.SETTLE


@dataclass(frozen=True)
class ModeChoice:
    """`choose_mode`'s answer, as a start-up record keeps it (`worker.startup.checkrecords`)."""

    mode: DecodeMode
    detail: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", DecodeMode(self.mode))  # read back from JSON as a plain string


def step_tokens(llm: Llama, token: int, mode: DecodeMode) -> tuple[list[int], int]:
    """The tokens that append ``token`` to the context in ``mode``, and the position they go at.

    In ``pair`` mode the previous token is decoded again beside it (its cell replaced).
    """
    n = llm.n_tokens
    if mode is DecodeMode.PAIR and n > 0:
        return [int(llm.input_ids[n - 1]), token], n - 1
    return [token], n


def decode_step(llm: Llama, token: int, mode: DecodeMode) -> None:
    """Append ``token`` to the context; its logits are then the last ones."""
    tokens, pos = step_tokens(llm, token, mode)
    llm.n_tokens = pos  # `Llama.eval` drops every cell from here on: in pair mode, the previous token's too
    llm.eval(tokens)


def answer_held(llm: Llama, tokens: list[int], generated: list[int]) -> list[int] | None:
    """Prompt plus answer as far as the context holds them: every token but the answer's last, or None.

    Sampling stops before decoding the token it ends on (an end of text, a length or a
    stop-sequence finish). That token is not decoded after the answer either: that step
    took 40-85 ms of the worker's time between two jobs at concurrency 1 on SmolLM2
    (`docs/bench/exact-decoding.md`), while the next job waited, and whoever continues the
    conversation evaluates it with the rest of the new turn, once. None when the context
    holds something else.
    """
    n = llm.n_tokens
    held = (tokens + generated)[:n]
    if not generated or n < len(tokens) or llm.input_ids[:n].tolist() != held:
        return None
    return held


def decoded_logits(llm: Llama, prompt: list[int], answer: list[int], mode: DecodeMode | None) -> np.ndarray:
    """The last logits after ``prompt`` is evaluated and ``answer`` decoded token by token in ``mode``
    (None: evaluated with the prompt, as a cold evaluation of both does). Leaves the context empty."""
    return segment_logits(llm, [(prompt, answer)], mode)[-1]


def segment_logits(llm: Llama, probe: Probe, mode: DecodeMode | None) -> list[np.ndarray]:
    """The last logits at the end of each segment of ``probe``, its prompt pieces evaluated and its answer pieces
    decoded token by token in ``mode``, one segment after another in one context (None: everything evaluated as
    prompt, a cold evaluation). Leaves the context empty."""
    tokens = [t for prompt, answer in probe for t in prompt + answer]
    try:
        llm.reset()
        got, pos = [], 0
        for prompt, answer in probe:
            if mode is None:  # prompt batches give every token the same bits whatever the split: this is cold
                evaluate_prompt(llm, tokens[: pos + len(prompt) + len(answer)], pos)
            else:
                evaluate_prompt(llm, tokens[: pos + len(prompt)], pos)
                for token in answer:
                    decode_step(llm, token, mode)
            pos += len(prompt) + len(answer)
            got.append(last_logits(llm))
        return got
    finally:
        llm.reset()


def _same(llm: Llama, probe: Probe, mode: DecodeMode, cold: list[np.ndarray]) -> bool:
    try:
        return all(np.array_equal(got, want) for got, want in zip(segment_logits(llm, probe, mode), cold, strict=True))
    except Exception:  # a memory that cannot drop a cell (recurrent) cannot decode in pairs
        return False


def check_probe(llm: Llama, seed: int = 1) -> Probe:
    """Random tokens in `CHECK_SEGMENTS`: a prompt piece, an answer decoded after it, another prompt piece, and so on.

    Whether a decoded token keeps the cold bits depends on the input as well as the build:
    on an AVX2 build Gemma 3's single decoding matched a cold evaluation after one random
    40-token prompt and 6 steps, the one probe the check once ran, and differed at the
    first to eighth step after nine others, so the worker decoded inexactly. Thirty steps
    at three depths, each end compared, catch what one short probe let through, for about
    the cost of that one probe. A context too small for all three segments gets those that fit.
    """
    rng = np.random.default_rng(seed)
    room = min(llm.n_ctx(), len(llm.input_ids))  # llama.cpp may round the context up; the token buffer is what fits
    sizes = [(p, a) for i, (p, a) in enumerate(CHECK_SEGMENTS) if sum(map(sum, CHECK_SEGMENTS[: i + 1])) <= room]
    if not sizes:  # a context smaller than the first segment: as much of one as fits
        sizes = [(max(2, room // 2), max(1, room - max(2, room // 2)))]
    probe: Probe = []
    for n_prompt, n_answer in sizes:
        tokens = [int(t) for t in rng.integers(3, llm.n_vocab(), n_prompt + n_answer)]
        probe.append((tokens[:n_prompt], tokens[n_prompt:]))
    return probe


def choose_mode(llm: Llama, wanted: str, probes: list[Probe] | None = None) -> tuple[DecodeMode, str]:
    """The cheapest exact mode this model and build allow (``wanted`` ``auto``), or ``wanted`` if it proves exact.

    A mode is exact when, for every probe (by default `check_probe`'s one), the logits at
    the end of each of its segments, answers decoded in that mode, are the bits of a cold
    evaluation of everything up to there: every cell a decoded token left (and every one
    before it) enters those logits. Random tokens, so that the check depends on nothing
    but the model and build. Returns the mode and why; a mode that fails falls back to
    `DecodeMode.SETTLE`.
    """
    if wanted == "off":
        return DecodeMode.SETTLE, "exact decoding turned off (KVPOOL_EXACT_DECODE=off)"
    probes = probes if probes is not None else [check_probe(llm)]
    cold = [segment_logits(llm, probe, None) for probe in probes]
    failed: list[str] = []
    for mode in [DecodeMode(wanted)] if wanted != "auto" else [DecodeMode.SINGLE, DecodeMode.PAIR]:
        if all(_same(llm, probe, mode, want) for probe, want in zip(probes, cold, strict=True)):
            return mode, f"{mode} decoding matches a cold evaluation" + (f" ({', '.join(failed)} does not)" if failed else "")
        failed.append(str(mode))
    return DecodeMode.SETTLE, f"no exact decoding on this build and layout ({', '.join(failed)} differs from a cold evaluation)"


# -- the fallback: the completion evaluated again, at idle time ------------------------

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
