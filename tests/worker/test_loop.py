"""The engine loop keeps a failure with the request at fault, and runs a generation on its own thread.

A real context of two sequences on the generated tiny model, in this process; the loop is held
by a task while two decode requests queue, so that both go into one ``llama_decode`` call.
A generation (`EngineLoop.generate`, `SeqView.generate`) is sampled step after step by the
loop: its job's thread hands it over once and wakes once.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from tests.helpers import in_one_round, poll
from worker.engine.context import Context
from worker.engine.llama_state import read_seq_state, restore_seq_state
from worker.engine.loop import EngineLoop, after_round
from worker.engine.rounds import Request
from worker.engine.sequence import SeqView
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


def greedy_by_hand(loop: EngineLoop, seq: int, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``, each step decoded by a request of this thread."""
    logits = loop.decode(seq, prompt, 0)
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = loop.decode(seq, [out[-1]], len(prompt) + len(out) - 1)
    return out


def test_a_generation_is_stepped_and_sampled_by_the_loop_alone_until_it_says_done(loop: EngineLoop) -> None:
    prompt = [5, 6, 7, 8, 9, 10]
    expected = greedy_by_hand(loop, 1, prompt, 12)
    first = int(np.argmax(loop.decode(0, prompt, 0)))
    got, threads = [first], set()

    def advance(req: Request) -> tuple[list[int], int] | None:
        threads.add(threading.current_thread().name)
        assert req.out is not None
        got.append(int(np.argmax(req.out)))
        return ([got[-1]], req.pos + 1) if len(got) < 12 else None

    rounds = loop.rounds
    loop.generate(0, [first], len(prompt), advance)
    assert got == expected, "the same greedy tokens as steps decoded one request at a time"
    assert threads == {"kvpool-loop"}, "every step advanced on the loop's thread"
    assert loop.rounds - rounds == 11 and loop.pending() == 0, "one round a step, nothing left behind"
    assert positions(loop, 0) == (0, len(prompt) + 10), "the cells of every token decoded: all but the last sampled"


def test_an_error_raised_while_advancing_fails_that_generation_and_the_loop_goes_on(loop: EngineLoop) -> None:
    loop.decode(0, [5, 6, 7], 0)

    def advance(req: Request) -> tuple[list[int], int] | None:
        raise ValueError("the job's stream is gone")

    with pytest.raises(ValueError, match="stream is gone"):
        loop.generate(0, [4], 3, advance)
    assert loop.decode(1, [1, 2], 0).shape == (loop.n_vocab,), "the loop serves the next request"


def test_a_generation_its_job_leaves_mid_way_leaves_records_saying_what_its_cells_hold(loop: EngineLoop) -> None:
    """A job timeout reaching the job's thread while the loop is between two steps: the view's tokens held end where its cells do."""
    view = SeqView(loop, 0, 2, 256)
    view.eval([5, 6, 7, 8])
    steps, arrived = 0, threading.Event()

    class JobTimeout(Exception):  # raised in the job's thread as RQ's timeout is: asynchronously
        def __init__(self) -> None:
            arrived.set()

    def next_step() -> tuple[list[int], int] | None:
        nonlocal steps
        steps += 1
        if steps >= 5:
            arrived.wait(30)  # the loop holds the chain until the timeout is in the job's thread
        return [int(view.input_ids[view.n_tokens - 1]), 9], view.n_tokens - 1  # pair steps: the previous token again

    outcome: list[BaseException] = []

    def job() -> None:
        try:
            view.generate([8, 9], 3, next_step)
        except JobTimeout as e:
            outcome.append(e)

    thread = threading.Thread(target=job)
    thread.start()
    poll(lambda: steps >= 5, "five steps")
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(JobTimeout))
    thread.join(30)
    assert not thread.is_alive() and len(outcome) == 1, "generate raised the job's timeout once the loop let go"
    poll(lambda: loop.pending() == 0, "the abandoned step dropped")
    assert positions(loop, 0) == (0, view.n_tokens - 1), f"records say {view.n_tokens} tokens held"
    assert view.n_tokens >= 8 and view.input_ids[: view.n_tokens].tolist() == [5, 6, 7, 8] + [9] * (view.n_tokens - 4)


class _Recorded(SeqView):
    """A view that notes which thread sets its tokens held."""

    def __init__(self, *args: object) -> None:
        self.set_by: list[str] = []
        super().__init__(*args)  # type: ignore[arg-type]

    @property  # type: ignore[override]
    def n_tokens(self) -> int:
        return self._n

    @n_tokens.setter
    def n_tokens(self, n: int) -> None:
        self._n = n
        self.set_by.append(threading.current_thread().name)


def test_a_prompt_piece_and_a_restore_record_what_the_cells_hold_in_the_task_that_changes_them(loop: EngineLoop) -> None:
    """One owner: the records of a decoded piece and of a restored state are set on the loop's thread, not after it by the job."""
    source = SeqView(loop, 1, 2, 256)
    source.eval([5, 6, 7, 8, 9, 10])
    state = bytes(read_seq_state(source))

    view = _Recorded(loop, 0, 2, 256)
    view.set_by.clear()
    view.eval([11, 12, 13, 14])
    assert view.n_tokens == 4 and view.set_by == ["kvpool-loop"], view.set_by
    view.set_by.clear()
    restore_seq_state(view, state, [5, 6, 7, 8, 9, 10])
    assert view.n_tokens == 6 and view.input_ids[:6].tolist() == [5, 6, 7, 8, 9, 10]
    assert set(view.set_by) == {"kvpool-loop"}, f"set by {view.set_by}: the clear and the load, each in its task"
    assert positions(loop, 0) == (0, 5)


def test_a_job_that_gives_up_as_its_prompt_piece_is_recorded_keeps_cells_and_records_together(loop: EngineLoop) -> None:
    """A job timeout reaching the job's thread while the loop records its finished piece: the piece is done, not abandoned,
    so its cells are not purged under records that say they are held."""
    view = SeqView(loop, 0, 2, 256)
    view.eval([5, 6, 7, 8])
    recording, arrived = threading.Event(), threading.Event()

    class JobTimeout(Exception):  # raised in the job's thread as RQ's timeout is: asynchronously
        def __init__(self) -> None:
            arrived.set()

    def record(req: Request) -> None:
        recording.set()
        arrived.wait(30)  # the timeout reaches the job's thread while the loop records
        view._record(req)

    outcome: list[BaseException] = []

    def job() -> None:
        try:
            loop.decode(0, [9, 10, 11], 4, record=record)
        except JobTimeout as e:
            outcome.append(e)

    thread = threading.Thread(target=job)
    thread.start()
    poll(recording.is_set, "the loop recording the piece")
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0), ctypes.py_object(JobTimeout))
    thread.join(30)
    assert not thread.is_alive() and len(outcome) == 1
    poll(lambda: loop.pending() == 0, "the loop idle")
    assert view.n_tokens == 7 and view.input_ids[:7].tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert positions(loop, 0) == (0, 6), "the recorded piece's cells are there"


def test_what_a_rounds_tokens_ask_for_runs_once_after_every_chain_of_the_round_has_sent_its_token(loop: EngineLoop) -> None:
    """`after_round`: the worker's stream write waits for the round's last token, so one write carries every sequence's step."""
    prompt = [5, 6, 7, 8]
    for seq in (0, 1):
        loop.decode(seq, prompt, 0)
    sent: list[int] = []
    writes: list[list[int]] = []
    steps = {0: 0, 1: 0}

    def write() -> None:
        writes.append(sorted(sent))
        sent.clear()

    def advance(req: Request) -> tuple[list[int], int] | None:
        sent.append(req.seq)
        assert after_round(write), "asked while the loop advances a round"
        steps[req.seq] += 1
        return ([1], req.pos + 1) if steps[req.seq] < 6 else None

    assert not after_round(write), "outside a round (a job's thread): the caller writes at once"
    in_one_round(loop, lambda: loop.generate(0, [1], len(prompt), advance), lambda: loop.generate(1, [1], len(prompt), advance))
    assert writes == [[0, 1]] * 6, "one write a round, after both sequences' tokens, however many tokens asked for it"
