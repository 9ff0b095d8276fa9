"""How the batcher plans a round, and how it names each call of it for ``batcher.totals``.

Pure planning, no model: `plan_round` takes the requests waiting and returns the
``llama_decode`` calls of one round; `call_kinds` names each call by what it holds.
"""

from __future__ import annotations

from worker.batcher import CallKind, Request, call_kinds, plan_round


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
