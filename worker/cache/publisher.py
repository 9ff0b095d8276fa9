"""Publishing in the background: new chunks go to the store while generation goes on.

The engine hands over a copy of the sequence's cells from the first chunk the store lacked
when the job looked (a memcpy of the new cells alone, with kvpool's build of llama.cpp:
`worker.engine.llama_state.readable_from`) and moves on; a thread finds which full chunks, and
whether the partial last chunk (the tail), the store lacks, cuts just those and publishes them.
When the store is slow and tasks pile up past the queue bound, new tasks are dropped
and counted rather than holding up a job: the next request simply re-publishes.

A job's breakpoints (`worker.protocol.Breakpoint`, a client's ``cache_control``) are
published the same way, each prefix with its own tail, and then pinned in the store for
their TTL; a task with no state only pins (the store held everything already).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from store.chain import BlobKey, Namespace, tail_key
from store.checkpoints import Checkpoints
from store.errors import StoreError
from store.store import Store
from worker import metrics
from worker.cache.kvchunks import cut_cells, cut_state
from worker.engine.kvstate import Buffer, StateFormatError
from worker.protocol import Breakpoint

log = logging.getLogger("kvpool.worker.publish")

SPARE_BUFFERS = 2
"""State buffers kept for reuse (`Publisher.buffer`): a job snapshots at most twice (prompt, then answer)."""


@dataclass
class _Task:
    """What to publish: the namespace, the tokens, the state holding their cells, and what to run when done."""

    ns: Namespace
    tokens: list[int]
    keys: list[BlobKey]
    """The chain of ``tokens``, hashed once by the engine."""
    state: Buffer | None
    on_done: Callable[[], None] | None = None
    breakpoints: list[Breakpoint] = field(default_factory=list)
    checkpoints: Mapping[int, Buffer] = field(default_factory=dict)
    """Whole states by chunks covered (`store.checkpoints`), for memories that cannot be cut."""
    resumed: int = 0
    """Tokens the job that saved ``checkpoints`` resumed from: the prompt's tail checkpoints before them are superseded."""
    recycle: bool = False
    """``state``'s buffer came from `Publisher.buffer` and goes back once the task is over."""
    first: int = 0
    """The position of ``state``'s first cell: it holds the cells from there on (0: the whole sequence)."""


class Publisher:
    def __init__(self, store: Store, max_pending: int, labels: dict[str, str]) -> None:
        self.store = store
        self.checkpoints = Checkpoints(store)
        self.labels = labels
        self._spare: list[bytearray] = []
        """Buffers of finished tasks' states, for the next snapshot (`buffer`)."""
        self._spare_lock = threading.Lock()
        self._tasks: queue.Queue[_Task | None] = queue.Queue(maxsize=max_pending)
        """Tasks in order; ``None`` stops the thread."""
        self._thread = threading.Thread(target=self._run, name="kvpool-publisher", daemon=True)
        self._thread.start()

    def submit(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        keys: list[BlobKey],
        state: Buffer | None,
        on_done: Callable[[], None] | None = None,
        breakpoints: Sequence[Breakpoint] = (),
        *,
        recycle: bool = False,
        first: int = 0,
    ) -> bool:
        """Queue the chunks of ``tokens`` (chain ``keys``; cells from position ``first`` on in ``state``) for publishing,
        then pin the breakpoints; False if dropped.

        ``on_done`` runs once the task is over, whether it published, failed or was dropped.
        Chunks before ``first`` are not in ``state``: the store held them when the job looked.
        """
        return self._put(_Task(ns, list(tokens), keys, state, on_done, list(breakpoints), recycle=recycle, first=first))

    def submit_checkpoints(
        self, ns: Namespace, tokens: Sequence[int], keys: list[BlobKey], states: Mapping[int, Buffer], resumed: int = 0
    ) -> bool:
        """Queue whole-state checkpoints of ``tokens`` (tokens held -> state: on a boundary, or a tail) for publishing; False if dropped.

        Once they are stored, the prompt's tail checkpoints that end before ``resumed`` (where
        the job resumed) are dropped: `store.checkpoints.Checkpoints.supersede`.
        """
        return self._put(_Task(ns, list(tokens), keys, None, checkpoints=states, resumed=resumed))

    def _put(self, task: _Task) -> bool:
        try:
            self._tasks.put_nowait(task)
            return True
        except queue.Full:
            metrics.PUBLISH_ERRORS.labels(**self.labels, reason="queue_full").inc()
            log.warning("publish.dropped", extra={"reason": "queue full", "tokens": len(task.tokens)})
            if task.on_done is not None:
                task.on_done()
            return False

    def buffer(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes for a state to submit: a finished task's when one is big enough.

        A fresh bytearray of a long prompt's state (48 MB for SmolLM2 at 2,100 tokens) costs
        about 20 ms to zero and fault in before llama.cpp's 4 ms copy, on the worker's way
        to its next job; a recycled one costs nothing.
        """
        with self._spare_lock:
            fits = [b for b in self._spare if len(b) >= size]
            if fits:
                best = min(fits, key=len)
                self._spare.remove(best)
                return best
        return bytearray(size)

    def _recycle(self, state: Buffer | None) -> None:
        owner = state.obj if isinstance(state, memoryview) else state
        if isinstance(owner, bytearray):
            with self._spare_lock:
                self._spare = [*self._spare, owner][-SPARE_BUFFERS:]

    @property
    def pending(self) -> int:
        """Tasks queued or running."""
        return self._tasks.unfinished_tasks

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Block until every queued task is done (for tests, benchmarks and shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._tasks.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        self.wait_idle(timeout_s)
        self._tasks.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            on_done = None
            try:
                if task is None:
                    return
                on_done = task.on_done
                if task.checkpoints:
                    self._publish_checkpoints(task.ns, task.tokens, task.keys, task.checkpoints, task.resumed)
                if task.state is not None:
                    self._publish(task.ns, task.tokens, task.keys, task.state, task.first)
                self._keep(task, task.breakpoints)
            except (StoreError, StateFormatError) as e:
                metrics.PUBLISH_ERRORS.labels(**self.labels, reason=type(e).__name__).inc()
                log.warning("publish.failed", extra={"error": type(e).__name__, "reason": str(e)})
            except Exception:
                metrics.PUBLISH_ERRORS.labels(**self.labels, reason="unexpected").inc()
                log.exception("publish.failed")
            finally:
                if on_done is not None:
                    on_done()
                if task is not None and task.recycle:
                    self._recycle(task.state)
                self._tasks.task_done()

    def lacks(self, ns: Namespace, tokens: Sequence[int], keys: list[BlobKey], breakpoints: Sequence[Breakpoint]) -> bool:
        """Whether the store lacks part of a breakpoint's prefix (one round trip; an unreachable index counts as no)."""
        if not breakpoints:
            return False
        wanted: list[bytes] = []
        for b in breakpoints:
            head = keys[: b.tokens // ns.chunk_size]
            end = len(head) * ns.chunk_size
            wanted += [*head, *([tail_key(ns.parent_of(head, len(head)), tokens[end : b.tokens])] if end < b.tokens else [])]
        try:
            return not all(self.store.index.present(wanted))
        except StoreError:
            return False

    def _keep(self, task: _Task, breakpoints: list[Breakpoint]) -> None:
        """Publish each breakpoint's prefix (its tail, mostly: its chunks are the prompt's), then pin it."""
        now, c = time.time(), task.ns.chunk_size
        for b in breakpoints:
            tokens, keys = task.tokens[: b.tokens], task.keys[: b.tokens // c]
            if task.state is not None and b.tokens < len(task.tokens):
                self._publish(task.ns, tokens, keys, task.state, task.first)
            self.store.pin(task.ns, tokens, now + b.ttl_s, keys=keys)
        if breakpoints:
            log.info("publish.pinned", extra={"breakpoints": [b.tokens for b in breakpoints]})

    def _publish(self, ns: Namespace, tokens: list[int], keys: list[BlobKey], state: Buffer, first: int) -> None:
        """One presence check, then the chunks and the tail the store lacks, written and indexed in one round trip (`Store.publish`).

        A chunk before ``first`` that the store lost since the job looked is not in ``state``:
        the next job to evaluate it publishes it.
        """
        t0 = time.perf_counter()
        end = len(keys) * ns.chunk_size
        tail = tail_key(ns.parent_of(keys, len(keys)), tokens[end:]) if end < len(tokens) else None
        present = self.store.index.present([*keys, *([tail] if tail else [])])
        if all(present):
            return
        lacking = max(present.index(False), first // ns.chunk_size)
        todo = {}
        if lacking < len(keys):
            payloads = cut_state(state, ns.chunk_size, lacking, len(keys), first=first)
            todo = {i: p for i, p in zip(range(lacking, len(keys)), payloads) if not present[i]}
        tail_payload = cut_cells(state, end, len(tokens), first=first) if tail is not None and not present[-1] else None
        added = self.store.publish(ns, tokens, keys, todo, tail=tail_payload, absent=True)
        sent = sum(len(p) for p in todo.values()) + len(tail_payload or b"")
        metrics.PUBLISH_SECONDS.labels(**self.labels).observe(time.perf_counter() - t0)
        metrics.PUBLISH_BYTES.labels(**self.labels).inc(sent)
        log.info("publish.done", extra={"chunks": added, "from_chunk": lacking, "to_chunk": len(keys), "tail": tail_payload is not None})

    def _publish_checkpoints(
        self, ns: Namespace, tokens: list[int], keys: list[BlobKey], states: Mapping[int, Buffer], resumed: int
    ) -> None:
        t0 = time.perf_counter()
        c = ns.chunk_size
        boundaries = {end // c: bytes(st) for end, st in states.items() if end % c == 0}
        added = self.checkpoints.publish(ns, tokens, keys, boundaries)
        for end, st in states.items():
            if end % c:
                added += self.checkpoints.publish_tail(ns, tokens, keys, end, bytes(st))
        superseded = self.checkpoints.supersede(ns, tokens, keys, resumed) if resumed and max(states) > resumed else 0
        size = sum(len(st) for st in states.values())
        metrics.PUBLISH_SECONDS.labels(**self.labels).observe(time.perf_counter() - t0)
        metrics.PUBLISH_BYTES.labels(**self.labels).inc(size)
        log.info("publish.checkpoints", extra={"checkpoints": added, "ends": sorted(states), "bytes": size, "superseded": superseded})
