"""How generated tokens are decoded, so that their cells hold what a cold evaluation would.

A prompt is evaluated in batches of two or more tokens (`worker.llama_state.batch_sizes`),
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
* `DecodeMode.SETTLE`: neither is exact (a GPU backend, f16 with flash attention, a
  forced mode that failed its check). Generated cells are never reused or published as
  they are; the worker evaluates the completion again as prompt once the worker idles
  (`worker.engine.Engine.settle`), as every engine before exact decoding did.

In the exact modes the answer itself is what a cold evaluation of the prompt plus the
tokens so far gives at every step, so it is the same bits on every exact worker of a
kernel fingerprint, and the context holds the cold cells of the prompt and of every
answer token but the last (sampled, never decoded: `answer_held`): the next turn of a
chat resumes there, here or, published, anywhere.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np

from worker.llama_state import Llama, evaluate_prompt, last_logits

CHECK_PROMPT = 40
CHECK_STEPS = 6


class DecodeMode(StrEnum):
    SINGLE = "single"
    PAIR = "pair"
    SETTLE = "settle"

    @property
    def exact(self) -> bool:
        """Decoded cells are what a cold evaluation of the same tokens holds."""
        return self is not DecodeMode.SETTLE


def decode_step(llm: Llama, token: int, mode: DecodeMode) -> None:
    """Append ``token`` to the context; its logits are then the last ones."""
    if mode is DecodeMode.PAIR and llm.n_tokens > 0:
        prev = int(llm.input_ids[llm.n_tokens - 1])
        llm.n_tokens -= 1  # `Llama.eval` drops every cell from here on: the previous token's too
        llm.eval([prev, token])
    else:
        llm.eval([token])


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
    try:
        llm.reset()
        if mode is None:
            evaluate_prompt(llm, prompt + answer, 0)
            return last_logits(llm)
        evaluate_prompt(llm, prompt, 0)
        for token in answer:
            decode_step(llm, token, mode)
        return last_logits(llm)
    finally:
        llm.reset()


def _same(llm: Llama, prompt: list[int], answer: list[int], mode: DecodeMode, cold: np.ndarray) -> bool:
    try:
        return bool(np.array_equal(decoded_logits(llm, prompt, answer, mode), cold))
    except Exception:  # a memory that cannot drop a cell (recurrent) cannot decode in pairs
        return False


def choose_mode(llm: Llama, wanted: str, seed: int = 1) -> tuple[DecodeMode, str]:
    """The cheapest exact mode this model and build allow (``wanted`` ``auto``), or ``wanted`` if it proves exact.

    A mode is exact when the logits after a prompt and then an answer decoded in it are the
    bits of a cold evaluation of both: every cell the answer's tokens left (and every one
    before them) enters those logits. Random tokens, so that the check depends on nothing
    but the model and build. Returns the mode and why; a mode that fails falls back to
    `DecodeMode.SETTLE`.
    """
    if wanted == "off":
        return DecodeMode.SETTLE, "exact decoding turned off (KVPOOL_EXACT_DECODE=off)"
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(3, llm.n_vocab(), CHECK_PROMPT + CHECK_STEPS)]
    prompt, answer = tokens[:CHECK_PROMPT], tokens[CHECK_PROMPT:]
    cold = decoded_logits(llm, prompt, answer, None)
    failed: list[str] = []
    for mode in [DecodeMode(wanted)] if wanted != "auto" else [DecodeMode.SINGLE, DecodeMode.PAIR]:
        if _same(llm, prompt, answer, mode, cold):
            return mode, f"{mode} decoding matches a cold evaluation" + (f" ({', '.join(failed)} does not)" if failed else "")
        failed.append(str(mode))
    return DecodeMode.SETTLE, f"no exact decoding on this build and layout ({', '.join(failed)} differs from a cold evaluation)"
