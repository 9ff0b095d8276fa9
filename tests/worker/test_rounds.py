"""How the engine loop plans a round, and how it names each call of it for ``loop.totals``.

Pure planning, no model: `plan_round` takes the requests waiting and returns the
``llama_decode`` calls of one round; `call_kinds` names each call by what it holds.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.rounds import CallKind, Request, call_kinds, fillers, plan_round


def _steps(size: int, seqs: range) -> list[Request]:
    return [Request(seq=s, tokens=[7] * size, pos=40) for s in seqs]


def test_one_token_steps_and_a_prompt_go_in_two_calls_and_the_steps_are_counted_beside_it() -> None:
    prompt = Request(seq=3, tokens=list(range(100)), pos=0)
    calls = plan_round([*_steps(1, range(3)), prompt], n_ubatch=512, prefill_chunk=32)
    assert [[(r.seq, n) for r, n in c] for c in calls] == [[(0, 1), (1, 1), (2, 1)], [(3, 32)]]
    assert call_kinds(calls) == [CallKind.STEPS_BESIDE_PROMPT, CallKind.PROMPT]


def test_two_token_steps_share_their_call_with_a_prompt_piece() -> None:
    prompt = Request(seq=3, tokens=list(range(100)), pos=0)
    calls = plan_round([*_steps(2, range(3)), prompt], n_ubatch=512, prefill_chunk=32)
    assert len(calls) == 1 and call_kinds(calls) == [CallKind.MIXED]


def test_rounds_of_steps_alone_and_of_a_prompt_alone() -> None:
    assert call_kinds(plan_round(_steps(1, range(4)), n_ubatch=512, prefill_chunk=32)) == [CallKind.STEPS]
    alone = plan_round([Request(seq=0, tokens=list(range(600)), pos=0)], n_ubatch=512, prefill_chunk=32)
    assert [n for c in alone for _, n in c] == [512] and call_kinds(alone) == [CallKind.PROMPT]


# The start-up costs of steps in 1 ... 4 consecutive sequences, ms (docs/bench/rounds-2026-12-06/fillers-*.txt).
WEIGHT_BOUND = [58.5, 63.1, 69.1, 76.6]  # the 1.1B f16 bench model: a row more costs little beside a pass over the weights
ROW_BOUND = [6.4, 13.6, 16.6, 19.8]  # SmolLM2: a row more costs more than a second pass


def test_idle_sequences_between_steps_get_fillers_where_one_pass_costs_less_than_two() -> None:
    assert fillers([0, 2], WEIGHT_BOUND) == [1]
    assert fillers([3, 0], WEIGHT_BOUND) == [1, 2]
    assert fillers([0, 1, 3], WEIGHT_BOUND) == [2]


def test_no_fillers_where_rows_cost_more_than_passes_or_nothing_is_apart() -> None:
    assert fillers([0, 2], ROW_BOUND) == []
    assert fillers([0, 1, 2], WEIGHT_BOUND) == []  # one micro-batch already
    assert fillers([1], WEIGHT_BOUND) == [] and fillers([0, 2], None) == []
    assert fillers([0, 5], WEIGHT_BOUND) == []  # a span larger than was measured


@st.composite
def _queues(draw: st.DrawFn) -> tuple[list[Request], int, int]:
    """Requests waiting, one per sequence (steps of one or two tokens, prompts part evaluated), n_ubatch and the piece budget."""
    n_seq = draw(st.integers(1, 8))
    queue = []
    for seq in draw(st.permutations(range(n_seq))):
        if draw(st.booleans()):
            queue.append(Request(seq=seq, tokens=[7] * draw(st.integers(1, 2)), pos=40))
        else:
            req = Request(seq=seq, tokens=list(range(draw(st.integers(3, 700)))), pos=0, rows=draw(st.booleans()))
            req.done = draw(st.integers(0, len(req.tokens) - 2))  # pieces never leave one token: at least two are left
            queue.append(req)
    return queue, draw(st.integers(3, 600)), draw(st.integers(4, 700))


@given(_queues())
@settings(max_examples=400, deadline=None)
def test_every_round_keeps_the_rules_that_keep_the_cold_bits(case: tuple[list[Request], int, int]) -> None:
    """The module's rules, for any queue: no call over ``n_ubatch``; steps of one size per call; a prompt piece beside
    steps only when it is at least two tokens longer than they are; one piece a round, of the oldest prompt, never
    leaving a lone last token; every step in the round."""
    queue, n_ubatch, prefill_chunk = case
    calls = plan_round(queue, n_ubatch, prefill_chunk)
    placed = [r for call in calls for r, _ in call]
    assert len(placed) == len(set(map(id, placed))), "a request twice in one round"
    assert {id(r) for r in queue if r.is_step} <= set(map(id, placed)), "a generating sequence skipped"
    prompts = [(r, n) for call in calls for r, n in call if not r.is_step]
    waiting = [r for r in queue if not r.is_step]
    assert len(prompts) == (1 if waiting else 0) and (not prompts or prompts[0][0] is waiting[0])
    for call in calls:
        assert 0 < sum(n for _, n in call) <= n_ubatch
        steps = {n for r, n in call if r.is_step}
        assert len(steps) <= 1, "steps of different sizes in one call"
        for r, n in call:
            assert 1 <= n <= r.left and r.left - n != 1
            if not r.is_step and steps:
                (k,) = steps
                assert k >= 2 and n >= k + 2
