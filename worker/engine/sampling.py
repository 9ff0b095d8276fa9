"""Sampling from an evaluated prompt: one or ``n`` choices, penalties, a grammar, logprobs.

The prompt is evaluated (or restored) once. Each further choice rewinds the context to
the end of the prompt (`Rewind`), which costs the last two prompt tokens: they are
evaluated again in one two-token batch, and llama.cpp gives a batch of two or more
tokens the same bits whatever the split, so every choice samples its first token from
logits bit-identical to a cold evaluation's (see `worker.answering`).

Choice ``i`` of a request with a seed samples with seed ``seed + i``: choices differ,
and each is reproducible.

A choice's tokens become text as they come (`TextStream`): whole UTF-8 characters only,
text that could begin a stop string held back until it is clearly not one.
"""

from __future__ import annotations

import codecs
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import llama_cpp
import numpy as np

from worker.engine.llama_state import Llama, is_end_of_generation, last_logits
from worker.protocol import ChoiceResult, FinishReason, JobResult, JobSpec, SamplingParams, StoreStatus, Timings, TokenEvent, Usage

Emit = Callable[[TokenEvent], bool]
"""Sends one token event; returns False when the job was cancelled."""
Rewind = Callable[[], None]
"""Brings the context back to the evaluated prompt, its last token's logits fresh."""
Steps = Callable[[int, Callable[[], "int | None"]], None]
"""Decodes a sampled token, then, on the engine loop's thread after each step, the token the
second argument samples from that step's logits, until it gives None (`worker.answering.Engine`)."""


@dataclass
class Output:
    """One choice as it was generated."""

    index: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish: FinishReason = "length"
    t_first: float | None = None
    stop_sequence: str | None = None


def sample_choices(
    llm: Llama, spec: JobSpec, emit: Emit, after_first: Callable[[], None], n_ctx: int, rewind: Rewind, steps: Steps
) -> list[Output]:
    """The job's ``n`` choices, one after the other; a cancelled choice ends the job."""
    outs: list[Output] = []
    grammar = llama_cpp.LlamaGrammar.from_string(spec.sampling.grammar, verbose=False) if spec.sampling.grammar else None
    for i in range(spec.sampling.n):
        if i:
            rewind()
        out = _one(llm, spec, emit, after_first if i == 0 else _nothing, n_ctx, i, grammar, steps)
        outs.append(out)
        if out.finish == "cancelled":
            break
    return outs


def job_result(
    spec: JobSpec,
    outs: list[Output],
    usage: Usage,
    timings: Timings,
    scored: list[TokenEvent] | None,
    *,
    worker: str,
    store_status: StoreStatus,
    restore_choice: str | None = None,
) -> JobResult:
    """The job's answer: its first choice, the others as ``extra_choices``; logprobs where they were asked for."""
    out, want_lp = outs[0], spec.sampling.logprobs is not None
    return JobResult(
        text=out.text,
        finish_reason=out.finish,
        tokens=out.tokens,
        usage=usage,
        timings=timings,
        worker=worker,
        store_status=store_status,
        restore_choice=restore_choice,
        stop_sequence=out.stop_sequence,
        logprobs=out.logprobs if want_lp else None,
        extra_choices=[
            ChoiceResult(index=o.index, text=o.text, finish_reason=o.finish, tokens=o.tokens, logprobs=o.logprobs if want_lp else None)
            for o in outs[1:]
        ],
        prompt_logprobs=scored,
    )


def _nothing() -> None:
    return None


def _seed(s: SamplingParams, index: int) -> int:
    return (s.seed + index) % 2**32 if s.seed is not None else random.randrange(2**32)


class Choice:
    """One choice being sampled: each token is checked, sent and counted by `take`.

    The first token is sampled by the job's thread from the evaluated prompt; every later
    one by the engine loop right after the step that decoded the token before it (`next`,
    `Steps`), so the job's thread does not wake per token.
    """

    def __init__(self, llm: Llama, spec: JobSpec, emit: Emit, n_ctx: int, index: int) -> None:
        self.llm, self.emit, self.s = llm, emit, spec.sampling
        self.out = Output(index=index)
        self.stream = TextStream(llm, self.s.stop)
        self.budget = min(self.s.max_tokens, n_ctx - len(spec.tokens))

    def take(self, tok: int) -> bool:
        """Record and send the sampled ``tok``; whether the choice goes on (its token then decoded)."""
        s, out = self.s, self.out
        if out.t_first is None:
            out.t_first = time.perf_counter()
        if is_end_of_generation(self.llm, tok):
            out.finish = "stop"
            if s.prompt_logprobs is not None and s.logprobs is not None:
                self.emit(end_event(self.llm, tok, s.logprobs, out.index))
            return False
        out.tokens.append(tok)
        if not self.emit(token_event(self.llm, tok, self.stream.push(tok), s.logprobs, out)):
            out.finish = "cancelled"
            return False
        if self.stream.stopped or len(out.tokens) >= self.budget:
            out.finish = "stop" if self.stream.stopped else "length"
            return False
        return True

    def next(self) -> int | None:
        """The next token, sampled from the last step's logits, if the choice goes on with it (on the loop's thread)."""
        tok = self.llm.sample(idx=None)
        return tok if self.take(tok) else None

    def end(self) -> Output:
        """The choice as generated: text held back for a stop string that never came is sent."""
        out, stream = self.out, self.stream
        if out.finish != "cancelled" and not stream.stopped and (tail := stream.flush()):
            self.emit(TokenEvent(text=tail, token=-1, index=out.index))
        out.text, out.stop_sequence = stream.text, stream.matched
        return out


def _one(
    llm: Llama,
    spec: JobSpec,
    emit: Emit,
    after_first: Callable[[], None],
    n_ctx: int,
    index: int,
    grammar: llama_cpp.LlamaGrammar | None,
    steps: Steps,
) -> Output:
    """Sample one choice, streaming each token; ``after_first`` runs once its first token is out.

    The sampler chain is llama-cpp-python's (`Llama.generate` builds the same one); the
    decoding is ours, so that the engine decides how each token's cells are computed. A
    token whose successor is never asked for is never decoded.
    """
    choice = Choice(llm, spec, emit, n_ctx, index)
    llm.set_seed(_seed(spec.sampling, index))
    llm._sampler = _sampler(llm, spec.sampling, grammar)
    try:
        if choice.budget > 0:
            first = llm.sample(idx=None)  # the evaluated prompt's last logits, through the chain set above
            go_on = choice.take(first)
            if choice.out.tokens and choice.out.finish != "cancelled":
                after_first()
            if go_on:
                steps(first, choice.next)
    finally:
        llm._sampler = None
    return choice.end()


def _sampler(llm: Llama, s: SamplingParams, grammar: llama_cpp.LlamaGrammar | None) -> Any:
    return llm._init_sampler(
        top_k=s.top_k,
        top_p=s.top_p,
        min_p=s.min_p,
        temp=s.temperature,
        repeat_penalty=s.repeat_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logits_processor=_bias(s.logit_bias) if s.logit_bias else None,
        grammar=grammar,
    )


def token_event(llm: Llama, tok: int, text: str, top_n: int | None, out: Output) -> TokenEvent:
    if top_n is None:
        return TokenEvent(text=text, token=tok, index=out.index)
    lp, top = logprobs_of(llm, last_logits(llm), tok, top_n)
    out.logprobs.append(lp)
    piece = llm.detokenize([tok]).decode("utf-8", "replace")
    return TokenEvent(text=text, token=tok, piece=piece, logprob=lp, top_logprobs=top, index=out.index)


def end_event(llm: Llama, tok: int, top_n: int, index: int) -> TokenEvent:
    """The end-of-generation token of a scored prompt's answer, with its logprob and no text.

    Evaluation harnesses (lm-eval's ``local-completions``) score ``prompt + one generated
    token`` and drop the last entry as the generated one; an answer that ends at once must
    still list that token, as vLLM and OpenAI's legacy completions do.
    """
    lp, top = logprobs_of(llm, last_logits(llm), tok, top_n)
    piece = llm.detokenize([tok], special=True).decode("utf-8", "replace")
    return TokenEvent(text="", token=tok, piece=piece, logprob=lp, top_logprobs=top, index=index)


def logprobs_of(llm: Llama, logits: np.ndarray, tok: int, top_n: int) -> tuple[float, dict[str, float] | None]:
    """The log-probability of ``tok`` under ``logits`` (the model's, before any sampler), and the ``top_n`` best."""
    logits = logits.astype(np.float64)
    m = logits.max()
    logz = m + np.log(np.exp(logits - m).sum())
    lp = float(logits[tok] - logz)
    if not top_n:
        return lp, None
    best = np.argpartition(-logits, top_n)[:top_n]
    best = best[np.argsort(-logits[best])]
    top = {llm.detokenize([int(i)]).decode("utf-8", "replace"): float(logits[i] - logz) for i in best}
    return lp, top


def _bias(bias: dict[int, float]) -> llama_cpp.LogitsProcessorList:
    ids = np.fromiter(bias.keys(), dtype=np.int64)
    values = np.fromiter(bias.values(), dtype=np.float32)

    def apply(_input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        scores[ids] += values
        return scores

    return llama_cpp.LogitsProcessorList([apply])


# -- text, as the tokens come ----------------------------------------------------------


class Detokenizer(Protocol):
    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes: ...


class TextStream:
    """Feeds token ids in, gets out text that is safe to show now.

    Text that could be the start of a stop string is held back until it is clearly not
    one; when a stop string appears, the text ends just before it (as in OpenAI's API).
    """

    def __init__(self, detok: Detokenizer, stop: Sequence[str] = ()) -> None:
        self.detok = detok
        self.stop = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._tokens: list[int] = []
        self._pending = ""
        self.text = ""
        self.stopped = False
        self.matched: str | None = None
        """The stop string that ended the text."""

    def push(self, token: int) -> str:
        """Add one token; return the text that became safe to emit (possibly empty)."""
        piece = self.detok.detokenize([token], prev_tokens=self._tokens or None)
        self._tokens.append(token)
        self._pending += self._decoder.decode(piece)
        for s in self.stop:
            at = self._pending.find(s)
            if at >= 0:
                self.stopped, self.matched = True, s
                return self._release(self._pending[:at])
        hold = max((k for s in self.stop for k in range(1, len(s)) if self._pending.endswith(s[:k])), default=0)
        return self._release(self._pending[: len(self._pending) - hold])

    def flush(self) -> str:
        """The generation ended without a stop string: release everything held back."""
        self._pending += self._decoder.decode(b"", final=True)
        return self._release(self._pending)

    def _release(self, out: str) -> str:
        self._pending = self._pending[len(out) :] if not self.stopped else ""
        self.text += out
        return out
