"""The engine loop keeps a failure with the request at fault: its neighbours in the same call get their logits.

A real context of two sequences on the generated tiny model, in this process; the loop is held
by a task while two decode requests queue, so that both go into one ``llama_decode`` call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from tests.helpers import poll
from worker.context import Context
from worker.loop import EngineLoop
from worker.settings import WorkerSettings


@pytest.fixture
def loop(tiny_model: Path) -> Iterator[EngineLoop]:
    context = Context(WorkerSettings(model=str(tiny_model), parallel=2, n_ctx=256, n_threads=1), tiny_model)
    yield context.loop
    context.close()


def positions(loop: EngineLoop, seq: int) -> tuple[int, int]:
    def read(llm: llama_cpp.Llama) -> tuple[int, int]:
        mem = llama_cpp.llama_get_memory(llm.ctx)
        return llama_cpp.llama_memory_seq_pos_min(mem, seq), llama_cpp.llama_memory_seq_pos_max(mem, seq)

    return loop.run(seq, read)


def in_one_round(loop: EngineLoop, *asks: Callable[[], object]) -> list[object]:
    """Run ``asks`` (decodes, each in a thread) in one round: the loop is held by a task until every one has queued."""
    running, gate = threading.Event(), threading.Event()
    out: list[object] = [None] * len(asks)

    def hold(llm: llama_cpp.Llama) -> None:
        running.set()
        gate.wait(30)

    def run(i: int) -> None:
        try:
            out[i] = asks[i]()
        except Exception as e:
            out[i] = e

    holder = threading.Thread(target=loop.run, args=(0, hold))
    holder.start()
    running.wait(30)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(asks))]
    for i, t in enumerate(threads, start=1):
        t.start()
        poll(lambda i=i: loop.pending() == i, "the request queued behind the held loop")
    gate.set()
    for t in [holder, *threads]:
        t.join(60)
    return out


@pytest.mark.fp_path  # the neighbour's logits are compared bit for bit with its step decoded alone
def test_a_request_whose_position_does_not_follow_its_cells_fails_alone_beside_a_healthy_step(loop: EngineLoop) -> None:
    loop.decode(0, [5, 6, 7, 8, 9], 0)
    loop.decode(1, list(range(10, 20)), 0)
    alone = loop.decode(0, [42], 5).copy()
    loop.run(0, lambda llm: llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), 0, 5, -1))

    calls = loop.calls
    healthy, broken = in_one_round(loop, lambda: loop.decode(0, [42], 5), lambda: loop.decode(1, [3], 20))  # 1 holds 0..9: 20 is no next
    assert isinstance(broken, RuntimeError) and "llama_decode returned" in str(broken)
    assert isinstance(healthy, np.ndarray) and np.array_equal(healthy, alone), "the neighbour got its logits, the bits of its step alone"
    assert loop.calls - calls == 3, "one call of both, then each half alone"
    assert positions(loop, 0) == (0, 5) and positions(loop, 1) == (0, 9), "each sequence holds what its successful calls put there"


def test_a_request_abandoned_by_an_exception_as_it_is_submitted_is_never_decoded(loop: EngineLoop) -> None:
    """An exception that reaches the job's thread between the submit and the wait (a job timeout) abandons the request too."""
    loop.decode(0, [5, 6, 7, 8, 9], 0)

    class Timer(BaseException):
        pass

    real = loop._submit

    def submit_then_interrupted(add: Callable[[], None]) -> None:
        real(add)
        raise Timer

    loop._submit = submit_then_interrupted  # type: ignore[method-assign]
    with pytest.raises(Timer):
        loop.decode(0, [1, 2, 3], 2)  # would remove cells 2.. and put 3 others there
    loop._submit = real  # type: ignore[method-assign]
    poll(lambda: loop.dropped == 1, "the abandoned request dropped")
    assert loop.pending() == 0 and positions(loop, 0) == (0, 1), "dropped and purged as any abandoned request, never decoded later"
