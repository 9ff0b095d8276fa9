"""One llama.cpp context, many sequences: every decode the sequences ask for, merged into shared batches.

A worker with ``KVPOOL_PARALLEL`` = P > 1 opens one context with P sequences, each in
a KV stream of its own (``n_seq_max`` = P, ``kv_unified`` off), and runs P jobs at once,
one per thread (`worker.sequence.SeqView` is each job's view of its sequence). Each
view's ``eval`` becomes a `Batcher` request; the batcher's thread is the only one that
calls ``llama_decode``. Each round it takes:

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
``settle`` mode) never share a call with a prompt. The start-up checks and
``tests/worker/test_batched.py`` compare every case with a cold evaluation bit for bit.

**Gathering.** The jobs sample in their own threads, so after a round the batcher waits
up to ``gather_s`` for each sequence it just stepped to ask for its next step, so that
the sequences keep decoding together; a sequence that takes longer (its client's stream,
a stop) is not waited for again until it steps again.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import llama_cpp
import numpy as np

log = logging.getLogger("kvpool.worker.batcher")


class BatcherClosed(RuntimeError):
    """The worker is shutting down: no decode runs any more."""


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

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done

    @property
    def is_step(self) -> bool:
        """A generated token (and its predecessor): decoded with the other sequences' steps."""
        return len(self.tokens) <= 2 and not self.rows


Piece = tuple[Request, int]
"""A request and how many of its next tokens go into a call."""


class Batcher:
    def __init__(self, llm: llama_cpp.Llama, *, n_ubatch: int, prefill_chunk: int, gather_s: float = 0.01) -> None:
        self.llm = llm
        self.n_vocab = llm.n_vocab()
        self.n_ubatch = n_ubatch
        self.prefill_chunk = max(4, prefill_chunk)
        self.gather_s = gather_s
        self.lock = threading.Lock()
        """Held for every call into the context: the batcher's decodes and the views' state reads and writes."""
        self._cv = threading.Condition()
        self._queue: list[Request] = []
        self._expected: set[int] = set()
        self._closed = False
        self._batch = llama_cpp.llama_batch_init(n_ubatch, 0, 1)
        self.on_death: Callable[[str, BaseException], None] | None = None
        """Told when the batcher's thread dies (`worker.supervision`): no decode runs any more."""
        self.rounds = 0
        self.calls = 0
        self.totals: dict[CallKind, CallTotals] = {}
        """Calls and their time by kind, logged once when the batcher closes (``batcher.totals``)."""
        self._thread = threading.Thread(target=self._run, name="kvpool-batcher", daemon=True)
        self._thread.start()

    # -- the views' side -------------------------------------------------------------

    def decode(self, seq: int, tokens: list[int], pos: int, *, rows: bool = False) -> np.ndarray:
        """Decode ``tokens`` of sequence ``seq`` at positions ``pos...``; the last token's logits (every token's with ``rows``)."""
        if len(tokens) == 0:
            raise ValueError("nothing to decode")
        req = Request(seq, list(tokens), pos, rows)
        with self._cv:
            if self._closed:
                raise BatcherClosed("the worker is stopping")
            self._queue.append(req)
            self._cv.notify_all()
        req.finished.wait()
        if req.error is not None:
            raise req.error
        assert req.out is not None
        return req.out

    def idle(self, seq: int) -> None:
        """``seq`` stopped generating: the next round does not wait for it."""
        with self._cv:
            self._expected.discard(seq)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        llama_cpp.llama_batch_free(self._batch)
        log.info(
            "batcher.totals",
            extra={"rounds": self.rounds, **{f"{k}_{f}": v for k, t in sorted(self.totals.items()) for f, v in t.fields().items()}},
        )

    # -- the batcher's thread ----------------------------------------------------------

    def _run(self) -> None:
        """The thread: rounds until closed. Should it die, every request waiting and every later one fails at once."""
        try:
            self._rounds()
        except BaseException as e:
            log.exception("batcher.died")
            with self._cv:
                self._closed = True
                self._fail_queued(BatcherClosed(f"the batcher's thread died: {type(e).__name__}: {e}"))
            if self.on_death is not None:
                self.on_death("kvpool-batcher", e)

    def _rounds(self) -> None:
        while True:
            with self._cv:
                if not self._wait_for_work():
                    return
                calls = plan_round(list(self._queue), self.n_ubatch, self.prefill_chunk)
            kinds = call_kinds(calls)
            for call, kind in zip(calls, kinds, strict=True):
                try:
                    self._call(call, kind)
                except Exception as e:  # never leave a job waiting on a thread that died
                    log.exception("batcher.call_failed")
                    for req, _n in call:
                        req.error = e
                        req.finished.set()
            self._settle_round(calls)

    def _wait_for_work(self) -> bool:
        """Wait for a request, then up to ``gather_s`` for the sequences stepped last round; False once closed."""
        while not self._queue and not self._closed:
            self._cv.wait()
        if self._closed:
            self._fail_queued(BatcherClosed("the worker is stopping"))
            return False
        deadline = time.monotonic() + self.gather_s
        while self._missing() and (left := deadline - time.monotonic()) > 0:
            self._cv.wait(left)
        self._expected -= self._missing()  # late this round: not waited for again until it steps again
        return True

    def _fail_queued(self, error: BaseException) -> None:
        """Every request waiting gets ``error``; the caller holds ``_cv``."""
        for req in self._queue:
            req.error = error
            req.finished.set()
        self._queue.clear()

    def _missing(self) -> set[int]:
        return self._expected - {r.seq for r in self._queue}

    def _settle_round(self, calls: list[list[Piece]]) -> None:
        with self._cv:
            self.rounds += 1
            for call in calls:
                for req, _n in call:
                    if req.finished.is_set() and req in self._queue:
                        self._queue.remove(req)
                        if req.is_step and req.error is None:
                            self._expected.add(req.seq)
            self._cv.notify_all()

    def _call(self, call: list[Piece], kind: CallKind) -> None:
        """One ``llama_decode`` of the pieces; each request whose last token went in gets its logits."""
        b = self._batch
        i = 0
        outputs: list[tuple[Request, int, int]] = []  # request, first batch index, tokens
        for req, n in call:
            last = req.done + n == len(req.tokens)
            for j in range(n):
                k = req.done + j
                b.token[i] = req.tokens[k]
                b.pos[i] = req.pos + k
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = req.seq
                b.logits[i] = 1 if req.rows or (last and j == n - 1) else 0
                i += 1
            outputs.append((req, i - n, n))
        b.n_tokens = i
        with self.lock:
            t0 = time.perf_counter()
            rc = llama_cpp.llama_decode(self.llm.ctx, b)
            self.totals.setdefault(kind, CallTotals()).add(i, time.perf_counter() - t0)
            self.calls += 1
            for req, first, n in outputs:
                self._collect(req, first, n, rc)

    def _collect(self, req: Request, first: int, n: int, rc: int) -> None:
        if rc != 0:
            req.error = RuntimeError(f"llama_decode returned {rc}")
            req.finished.set()
            return
        ctx = self.llm.ctx
        if req.rows:
            if req.out is None:
                req.out = np.empty((len(req.tokens), self.n_vocab), dtype=np.float32)
            for j in range(n):
                ptr = llama_cpp.llama_get_logits_ith(ctx, first + j)
                req.out[req.done + j] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        req.done += n
        if req.done == len(req.tokens):
            if not req.rows:
                ptr = llama_cpp.llama_get_logits_ith(ctx, first + n - 1)
                req.out = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
            req.finished.set()


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


def token_data(n_vocab: int) -> tuple[ctypes.Array, np.ndarray]:
    """A ``llama_token_data`` array for sampling, and a numpy view of it (fields id, logit, p)."""
    arr = (llama_cpp.llama_token_data * n_vocab)()
    view = np.ctypeslib.as_array(arr).view(np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)]))
    return arr, view
