"""Prompt-token logprobs (``echo`` with ``logprobs``), as evaluation harnesses use them for log-likelihood.

They come from the one evaluation of the prompt, with logits kept at every position. A
restored prefix has no logits (the store keeps KV cells, not outputs), so a scored prompt
is always evaluated from the start: every answer is then the cold one. Its chunks are
still published, so the prefix serves later plain requests.

Asking llama.cpp for every position's logits changes how many rows its last matrix
product has, which may move the last bits of the last position's logits. The last two
prompt tokens are therefore evaluated again as a normal batch afterwards, so the first
generated token is sampled from the same logits as in an unscored job.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from worker.engine.llama_state import Llama, evaluate_all_logits, evaluate_prompt
from worker.protocol import TokenEvent

ROWS = 64
"""Positions turned into log-probabilities at a time (bounds the float64 working set)."""


def score_prompt(llm: Llama, tokens: Sequence[int], top_n: int) -> list[TokenEvent]:
    """Evaluate ``tokens`` from an empty context; each token's logprob under the ones before it (the first has none)."""
    out = [_event(llm, tokens[0], None, None)]
    for pos, logits in evaluate_all_logits(llm, tokens):
        nxt = list(tokens[pos + 1 : pos + len(logits) + 1])
        for lo in range(0, len(nxt), ROWS):
            out += _rows(llm, logits[lo : lo + ROWS], nxt[lo : lo + ROWS], top_n)
    evaluate_prompt(llm, tokens, max(0, len(tokens) - 2))
    return out


def _rows(llm: Llama, logits: np.ndarray, targets: list[int], top_n: int) -> list[TokenEvent]:
    rows = logits[: len(targets)].astype(np.float64)
    m = rows.max(axis=1, keepdims=True)
    logz = m[:, 0] + np.log(np.exp(rows - m).sum(axis=1))
    events = []
    for j, tok in enumerate(targets):
        lp = float(rows[j, tok] - logz[j])
        top = None
        if top_n:
            best = np.argpartition(-rows[j], top_n)[:top_n]
            best = best[np.argsort(-rows[j, best])]
            top = {_piece(llm, int(i)): float(rows[j, i] - logz[j]) for i in best}
        events.append(_event(llm, tok, lp, top))
    return events


def _piece(llm: Llama, tok: int) -> str:
    return llm.detokenize([tok]).decode("utf-8", "replace")


def _event(llm: Llama, tok: int, lp: float | None, top: dict[str, float] | None) -> TokenEvent:
    piece = _piece(llm, tok)
    return TokenEvent(text=piece, token=tok, piece=piece, logprob=lp, top_logprobs=top)
