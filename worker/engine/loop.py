"""The engine loop: the one thread that touches a worker's llama.cpp context.

A worker opens one context (`worker.engine.context.Context`) with ``KVPOOL_PARALLEL`` = P
sequences and runs P jobs at once, one per RQ thread, each seeing its sequence as a
`worker.engine.sequence.SeqView`. The job threads never call llama.cpp on the context: they
hand the loop work and wait for its result. Two kinds of work:

* **decode requests** (`worker.engine.rounds.Request`): a prompt piece or a generated token of
  one sequence. Each round the loop plans the calls (`worker.engine.rounds.plan_round`), decodes
  them, and gives each request its logits.
* **tasks** (`Task`): anything else done to the context (reading a sequence's state for
  publishing, restoring one, removing cells, reading positions), run between rounds.

One iteration, as llama-server's ``update_slots`` and vLLM's ``EngineCore.step`` do it::

    wait for work ─▶ drop what was abandoned (and purge its cells) ─▶ run the tasks
        ▲                                                                 │
        └──── settle: answers out, abandoned requests purged ◀── plan the round, decode its calls

**Aborts at step boundaries.** A job waiting for a decode looks at its watch (the
client's cancel, `worker.process.jobstream`) between prompt pieces, and any exception that reaches
its thread while it waits (RQ's job timeout, a second SIGTERM) leaves it the same way:
the request is marked abandoned, the loop drops it before the next round and removes the
cells it added, so nothing of it reaches the sequence's next job. A client that leaves
during a long prompt costs at most the piece being decoded.

**Sampling in the loop.** A job's generation is a `worker.engine.rounds.Chain`: after each of
its steps the loop itself samples the next token, sends it to the job's stream and queues
the step that decodes it, all before the next round (`_advance`), as llama-server's
``update_slots`` samples each slot after its ``llama_decode``. A job's thread wakes once a
choice, when it ends, not once a token; the sequence's records (tokens held, logits)
change with its cells, on this thread. Since a chain's next step is queued before the
next round, the sequences that generate keep decoding together with no wait between rounds.

**One output per round.** What a round's tokens set off outside the loop (the write of every
job's stream, `worker.process.jobstream.Emitter`) waits until the round's last chain has sent its
token (`after_round`), so one write carries the step of every sequence, as vLLM's engine
core sends one output message per step; it then runs while the next round decodes.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import llama_cpp
import numpy as np

from worker.engine.rounds import Advance, CallKind, CallTotals, Chain, Piece, Request, StepCost, call_kinds, fillers, plan_round
from worker.errors import JobAborted

log = logging.getLogger("kvpool.worker.loop")

T = TypeVar("T")

WAIT_S = 0.05
"""How often a job waiting on the loop looks at its watch (and lets an exception raised in its thread through)."""

Watch = Callable[[], str | None]
"""Why the job should stop now (its client cancelled, ...), or None: asked between prompt pieces."""

_round = threading.local()
"""``pending``: what runs once the round being advanced on this thread has sent every token (`after_round`)."""


def after_round(fn: Callable[[], None]) -> bool:
    """Run ``fn`` once the loop has advanced every chain of the round it is advancing on this thread; False outside one.

    Called while a chain sends its token: ``fn`` (once, however many tokens asked for it)
    then runs when every chain of the round has sent its own, before the next round. False
    where no round is being advanced on this thread (a job's thread sends its first token):
    the caller runs it at once.
    """
    pending: dict[Callable[[], None], None] | None = getattr(_round, "pending", None)
    if pending is None:
        return False
    pending[fn] = None
    return True


class LoopClosed(RuntimeError):
    """The worker is shutting down: the loop takes no more work."""


@dataclass(eq=False)
class Task(Generic[T]):
    """Work on the context other than decoding, run by the loop between rounds; ``seq``: the sequence it is for."""

    seq: int
    fn: Callable[[llama_cpp.Llama], T]
    result: T | None = None
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)


class EngineLoop:
    def __init__(self, llm: llama_cpp.Llama, *, n_ubatch: int, prefill_chunk: int) -> None:
        self.llm = llm
        self.n_vocab = llm.n_vocab()
        self.n_ubatch = n_ubatch
        self.prefill_chunk = max(4, prefill_chunk)
        self._cv = threading.Condition()
        self._queue: list[Request] = []
        self._tasks: list[Task[Any]] = []
        self._closed = False
        self._batch: Any = llama_cpp.llama_batch_init(n_ubatch, 0, 1)
        self.on_death: Callable[[str, BaseException], None] | None = None
        """Told when the loop's thread dies (`worker.process.supervision`): no decode runs any more."""
        self.rounds = 0
        self.calls = 0
        self.dropped = 0
        """Requests dropped because their job stopped waiting."""
        self.idle_s = 0.0
        """Time spent with no work at all (every sequence idle or busy outside the loop)."""
        self.step_cost: StepCost | None = None
        """Measured cost of steps by how many consecutive sequences hold them (`measure_steps`): where set, gaps get fillers."""
        self.filled = 0
        """Filler tokens decoded (`worker.engine.rounds.fillers`)."""
        self.totals: dict[CallKind, CallTotals] = {}
        """Calls and their time by kind, logged once when the loop closes (``loop.totals``)."""
        self._thread = threading.Thread(target=self._run, name="kvpool-loop", daemon=True)
        self._thread.start()

    # -- the jobs' side ----------------------------------------------------------------

    def decode(
        self,
        seq: int,
        tokens: list[int],
        pos: int,
        *,
        rows: bool = False,
        watch: Watch | None = None,
        record: Callable[[Request], None] | None = None,
    ) -> np.ndarray:
        """Decode ``tokens`` of sequence ``seq`` at positions ``pos...`` (its cells from ``pos`` on removed first).

        Returns the last token's logits (every token's with ``rows``); ``record`` runs on the
        loop's thread once they are there (`Request.record`). Raises `JobAborted` when
        ``watch`` says so between pieces; then, as on any exception reaching this thread
        while it waits, the request is abandoned (see the module's doc).
        """
        if len(tokens) == 0:
            raise ValueError("nothing to decode")
        req = Request(seq, list(tokens), pos, rows, record=record)
        self._await(req, req.finished, watch)
        if req.error is not None:
            raise req.error
        assert req.out is not None
        return req.out

    def generate(self, seq: int, tokens: list[int], pos: int, advance: Advance, *, watch: Watch | None = None) -> None:
        """Decode the step ``tokens`` of ``seq`` at ``pos...``, then every step ``advance`` names after it, on the loop's thread.

        ``advance`` runs on the loop's thread after each step (see `worker.engine.rounds.Chain`);
        this returns when it says done, raises what it raised, and, as `decode`, abandons
        the chain on `JobAborted` or any exception reaching this thread, returning once
        the loop has let go of it.
        """
        chain = Chain(advance)
        self._await(Request(seq, list(tokens), pos, chain=chain), chain.finished, watch)
        if chain.error is not None:
            raise chain.error

    def _await(self, req: Request, done: threading.Event, watch: Watch | None) -> None:
        """Queue ``req`` and wait for ``done``, asking ``watch`` between waits; on any exception, abandon it."""
        try:  # the submit too: an exception between it and the wait would leave a request no one waits for
            self._submit(lambda: self._queue.append(req))
            while not done.wait(WAIT_S):
                if watch is not None and (why := watch()) is not None:
                    raise JobAborted(why)
                if not self._thread.is_alive() and not done.is_set():  # died holding a chain between two steps
                    raise LoopClosed("the engine loop's thread died")
        except BaseException:
            with self._cv:
                if not done.is_set():  # done (and recorded, `_collect`): its cells and records stay, as any finished request's
                    req.abandoned = True
                    if req.chain is not None:
                        req.chain.abandoned = True
                self._cv.notify_all()
            while req.chain is not None and not done.wait(WAIT_S) and self._thread.is_alive():
                pass  # the loop may be advancing it: its records are the loop's until it lets go
            raise

    def run(self, seq: int, fn: Callable[[llama_cpp.Llama], T]) -> T:
        """``fn(llm)`` on the loop's thread, between rounds; its result or its exception."""
        task: Task[T] = Task(seq, fn)
        self._submit(lambda: self._tasks.append(task))
        while not task.finished.wait(WAIT_S):
            pass  # a timed wait: an exception raised in this thread (a job timeout) gets through
        if task.error is not None:
            raise task.error
        return task.result  # type: ignore[return-value]

    def decoding(self, seq: int) -> bool:
        """Whether a decode request of sequence ``seq`` is in the loop now (for tests)."""
        with self._cv:
            return any(r.seq == seq for r in self._queue)

    def pending(self) -> int:
        """Decode requests and tasks the loop holds now (for tests and the totals)."""
        with self._cv:
            return len(self._queue) + len(self._tasks)

    def close(self) -> None:
        """Stop taking work (everything waiting fails with `LoopClosed`) and end the thread; once only."""
        with self._cv:
            if self._batch is None:
                return
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        batch, self._batch = self._batch, None
        if self._thread.is_alive():  # still in a call that uses the batch: never free it under it (the process is ending)
            log.warning("loop.close_timed_out", extra={"waited_s": 30})
        else:
            llama_cpp.llama_batch_free(batch)
        log.info(
            "loop.totals",
            extra={
                "rounds": self.rounds,
                "dropped": self.dropped,
                "idle_s": round(self.idle_s, 3),
                "filled": self.filled,
                **{f"{k}_{f}": v for k, t in sorted(self.totals.items()) for f, v in t.fields().items()},
            },
        )

    def _submit(self, add: Callable[[], None]) -> None:
        with self._cv:
            if self._closed:
                raise LoopClosed("the worker is stopping")
            add()
            self._cv.notify_all()

    # -- the loop's thread ---------------------------------------------------------------

    def _run(self) -> None:
        """The thread: iterations until closed. Should it die, everything waiting and everything later fails at once."""
        try:
            while self._iteration():
                pass
        except BaseException as e:
            log.exception("loop.died")
            with self._cv:
                self._closed = True
                self._fail_all(LoopClosed(f"the engine loop's thread died: {type(e).__name__}: {e}"))
            if self.on_death is not None:
                self.on_death("kvpool-loop", e)

    def _iteration(self) -> bool:
        with self._cv:
            if not self._wait_for_work():
                return False
            tasks, self._tasks = self._tasks, []
            dropped = self._take_abandoned()
        self._purge(dropped)
        for task in tasks:
            self._run_task(task)
        with self._cv:
            calls = plan_round([r for r in self._queue if not r.dropped], self.n_ubatch, self.prefill_chunk)
        for call, kind in zip(calls, call_kinds(calls), strict=True):
            self._call_or_split(call, kind)
        with self._cv:
            chained = self._settle_round(calls)
        self._advance(chained)
        with self._cv:
            dropped = self._take_abandoned()
        self._purge(dropped)
        return True

    def _wait_for_work(self) -> bool:
        """Wait for a request or a task; False once closed."""
        idle_from = time.monotonic()
        while not self._queue and not self._tasks and not self._closed:
            self._cv.wait()
        self.idle_s += time.monotonic() - idle_from
        if self._closed:
            self._fail_all(LoopClosed("the worker is stopping"))
            return False
        return True

    def _fail_all(self, error: BaseException) -> None:
        """Every request, chain and task waiting gets ``error``; the caller holds ``_cv``."""
        waiting: list[Request | Task[Any] | Chain] = [*self._queue, *self._tasks, *(r.chain for r in self._queue if r.chain)]
        for w in waiting:
            w.error = error
            w.finished.set()
        self._queue.clear()
        self._tasks.clear()

    def _take_abandoned(self) -> list[Request]:
        """The abandoned requests, out of the queue; the caller holds ``_cv``."""
        gone = [r for r in self._queue if r.dropped]
        for r in gone:
            self._queue.remove(r)
            r.finished.set()
            if r.chain is not None:
                r.chain.finished.set()
        self.dropped += len(gone)
        return gone

    def _purge(self, dropped: list[Request]) -> None:
        """Remove the cells abandoned requests added: the sequence's next job finds none of them."""
        for r in dropped:
            mem = llama_cpp.llama_get_memory(self.llm.ctx)
            llama_cpp.llama_memory_seq_rm(mem, r.seq, r.pos, -1)
            log.info("loop.dropped", extra={"seq": r.seq, "decoded": r.done, "left": r.left})

    def _run_task(self, task: Task[Any]) -> None:
        try:
            task.result = task.fn(self.llm)
        except Exception as e:
            task.error = e
        task.finished.set()

    def _settle_round(self, calls: list[list[Piece]]) -> list[Request]:
        """The round's finished requests out of the queue, their jobs woken; returns the chained ones, to advance."""
        self.rounds += 1
        chained: list[Request] = []
        for call in calls:
            for req, _n in call:
                if req.finished.is_set() and req in self._queue and not req.dropped:  # abandoned: purged below
                    self._queue.remove(req)
                    if req.chain is not None:
                        chained.append(req)
        self._cv.notify_all()
        return chained

    def _advance(self, chained: list[Request]) -> None:
        """Each chain's next step, sampled now and queued for the next round; a chain that is done, failed or abandoned ends."""
        steps: list[Request] = []
        _round.pending = {}
        for req in chained:
            chain = req.chain
            assert chain is not None
            step = None
            if req.error is not None:
                chain.error = req.error
            elif not chain.abandoned:
                try:
                    step = chain.advance(req)
                except Exception as e:  # the job's error (its stream failed, ...), never the loop's
                    chain.error = e
            if step is None:
                chain.finished.set()
            else:
                steps.append(Request(req.seq, step[0], step[1], chain=chain))
        with self._cv:
            for req in steps:
                if self._closed:
                    req.chain.error = LoopClosed("the worker is stopping")  # type: ignore[union-attr]
                    req.chain.finished.set()  # type: ignore[union-attr]
                else:  # one abandoned meanwhile is queued too: dropped at once, its cells purged as any other's
                    self._queue.append(req)
            self._cv.notify_all()
        pending, _round.pending = _round.pending, None
        for fn in pending:  # the round's tokens are all sent: what they asked for runs once (`after_round`)
            fn()

    def _call_or_split(self, call: list[Piece], kind: CallKind) -> None:
        """`_call`; where llama.cpp refuses it, the call's pieces again in two halves, down to one: only the request at fault fails.

        llama.cpp refuses a whole batch for one sequence's fault (positions that do not follow
        its cells, no room left in its stream), and its other sequences did nothing wrong:
        as llama-server halves a batch that found no room, the halves are decoded apart, each
        after the cells the failed call placed are removed, so a request's cells are those of
        one successful call.
        """
        try:
            rc = self._call(call, kind)
        except Exception as e:  # never leave a job waiting on a call that failed (one that got its logits keeps them)
            log.exception("loop.call_failed")
            for req, _n in call:
                if not req.finished.is_set():
                    req.error = e
                    req.finished.set()
            return
        if rc == 0:
            return
        mem = llama_cpp.llama_get_memory(self.llm.ctx)
        for req, _n in call:
            llama_cpp.llama_memory_seq_rm(mem, req.seq, req.pos + req.done, -1)  # back to before the call
        if len(call) > 1:
            log.warning("loop.call_split", extra={"rc": rc, "pieces": len(call), "seqs": sorted({r.seq for r, _ in call})})
            half = len(call) // 2
            for part in (call[:half], call[half:]):
                self._call_or_split(part, kind)
            return
        req = call[0][0]
        log.error("loop.request_failed", extra={"seq": req.seq, "pos": req.pos + req.done, "tokens": call[0][1], "rc": rc})
        req.error = RuntimeError(f"llama_decode returned {rc}")
        req.finished.set()

    def _call(self, call: list[Piece], kind: CallKind) -> int:
        """One ``llama_decode`` of the pieces (and fillers); each request whose last token went in gets its logits.

        Returns llama.cpp's status: where it is not 0, no request got anything (`_call_or_split` decides what follows).
        """
        mem = llama_cpp.llama_get_memory(self.llm.ctx)
        gaps = self._fillers(call, kind) if self.step_cost else []
        rows: list[tuple[int, Request | None, int]] = sorted(
            [(r.seq, r, n) for r, n in call] + [(seq, None, pos) for seq, pos in gaps], key=lambda e: e[0]
        )  # in sequence order: llama.cpp takes a micro-batch's sequences in the batch's order
        i = 0
        outputs: list[tuple[Request, int, int]] = []  # request, first batch index, tokens
        for seq, req, n in rows:
            if req is None:  # a filler: n is its position
                i = self._put(i, seq, [call[0][0].tokens[0]] * call[0][1], n, logits=False)
                continue
            if req.done == 0:  # a request replaces whatever its sequence holds from its position on
                llama_cpp.llama_memory_seq_rm(mem, req.seq, req.pos, -1)
            outputs.append((req, i, n))
            last = req.done + n == len(req.tokens)
            i = self._put(i, seq, req.tokens[req.done : req.done + n], req.pos + req.done, logits=req.rows, last=last)
        self._batch.n_tokens = i
        t0 = time.perf_counter()
        rc = llama_cpp.llama_decode(self.llm.ctx, self._batch)
        self.totals.setdefault(kind, CallTotals()).add(i, time.perf_counter() - t0)
        self.calls += 1
        self.filled += len(gaps) * call[0][1]
        for seq, pos in gaps:  # gone again: the sequence's cells, and where they are, as before the call
            llama_cpp.llama_memory_seq_rm(mem, seq, pos, -1)
        if rc == 0:
            for req, first, n in outputs:
                self._collect(req, first, n)
        return int(rc)

    def _put(self, i: int, seq: int, tokens: list[int], pos: int, *, logits: bool, last: bool = False) -> int:
        """Write ``tokens`` of ``seq`` from position ``pos`` at batch index ``i``; logits for all, or for the last if ``last``."""
        b = self._batch
        for j, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = t, pos + j, 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if logits or (last and j == len(tokens) - 1) else 0
            i += 1
        return i

    def _fillers(self, call: list[Piece], kind: CallKind) -> list[tuple[int, int]]:
        """(sequence, position) of a filler for each idle sequence between the call's steps, where it pays; all or none."""
        if kind not in (CallKind.STEPS, CallKind.STEPS_BESIDE_PROMPT):
            return []
        mem = llama_cpp.llama_get_memory(self.llm.ctx)
        k, n_ctx = call[0][1], llama_cpp.llama_n_ctx_seq(self.llm.ctx)
        gaps = [(seq, llama_cpp.llama_memory_seq_pos_max(mem, seq) + 1) for seq in fillers([r.seq for r, _ in call], self.step_cost)]
        if any(pos + k > n_ctx for _, pos in gaps) or sum(n for _, n in call) + k * len(gaps) > self.n_ubatch:
            return []  # a full sequence or batch keeps its gap: a micro-batch more, never a wrong cell
        return gaps

    def measure_steps(self, n_seq: int, k: int, reps: int = 3) -> list[float]:
        """`StepCost` of this model: the fastest of ``reps`` calls of ``k``-token steps in sequences 0 ... r-1, r = 1 ... n_seq.

        Run as a task: the tokens go after what each sequence holds and are removed again. Shorter
        where a call could not be made (`worker.engine.rounds.fillers` then leaves wider spans alone).
        """

        def measure(llm: llama_cpp.Llama) -> list[float]:
            mem = llama_cpp.llama_get_memory(llm.ctx)
            cost: list[float] = []
            for r in range(1, min(n_seq, self.n_ubatch // k) + 1):
                ends = [llama_cpp.llama_memory_seq_pos_max(mem, s) + 1 for s in range(r)]
                times = []
                for _ in range(reps):
                    i = 0
                    for s in range(r):
                        i = self._put(i, s, [1] * k, ends[s], logits=False, last=True)
                    self._batch.n_tokens = i
                    t0 = time.perf_counter()
                    rc = llama_cpp.llama_decode(llm.ctx, self._batch)
                    times.append(time.perf_counter() - t0)
                    for s in range(r):
                        llama_cpp.llama_memory_seq_rm(mem, s, ends[s], -1)
                    if rc != 0:  # no room (a small context): spans this wide get no fillers, the worker runs on
                        log.warning("loop.step_cost_failed", extra={"sequences": r, "rc": rc})
                        return cost
                cost.append(min(times))
            return cost

        return self.run(0, measure)

    def _collect(self, req: Request, first: int, n: int) -> None:
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
            with self._cv:  # the record and the wake-up together: a job that gives up after this finds its request done (`_await`)
                if req.record is not None and not req.dropped:
                    req.record(req)
                req.finished.set()


def token_data(n_vocab: int) -> tuple[ctypes.Array, np.ndarray]:
    """A ``llama_token_data`` array for sampling, and a numpy view of it (fields id, logit, p)."""
    arr = (llama_cpp.llama_token_data * n_vocab)()
    view = np.ctypeslib.as_array(arr).view(np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)]))
    return arr, view
