"""Whole-state checkpoints on the worker: saving them while a prompt is evaluated, restoring one, and proving it exact.

For memories that cannot be cut into per-token cells (`worker.llama_state.ContextCache`,
``checkpoints``): a sliding-window cache holds only the window's cells in its second
section, a recurrent memory one fixed block per sequence, a hybrid both. The state after
the first ``k`` chunks depends on those tokens alone, so a worker evaluating a prompt stops
at chunk boundaries, copies the whole sequence state (``llama_state_seq_get_data``) and
publishes it under the boundary's chain key (`store.checkpoints`). Another worker
restores the deepest checkpoint on a prompt's chain and evaluates the rest.

A sliding-window checkpoint holds only the window: restored, its cells sit at the start of
the cache, shifted from where a cold evaluation puts them (cell index = position) by the
window's first position. llama.cpp's attention sums over cells in blocks, so a shift that
is not a multiple of 16 changes the last bits of the logits (measured on Gemma 3 270M: 5
of 7 such shifts differed, all 30 multiples of 16 were exact). Window models are therefore
checkpointed only where the shift is a multiple of `WINDOW_ALIGN` (`aligned`), and a
restore whose shift is not is refused.

The exactness rules are those of cells. Every piece evaluated is at least two tokens
(boundaries are whole chunks apart, and the last two prompt tokens are always evaluated
together), so each token comes out of the batched kernels whatever the split, and the
start-up check (`worker.selfcheck.check_checkpoint`) proves on this model and CPU that a checkpoint
restored and continued gives the cold evaluation's logits to the bit. A worker whose check
fails serves cold.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.kvstate import Buffer
from worker.llama_state import Llama, StateRestoreError, clear_seq, evaluate_prompt, read_seq_state, restore_seq_state, seq_positions

WINDOW_ALIGN = 32
"""A window model's checkpoint is taken only where its window starts at a multiple of this (see above)."""


def aligned(pos: int, n_swa: int) -> bool:
    """Whether a checkpoint after ``pos`` tokens restores with the cold bits: its window (the last ``n_swa``) starts aligned."""
    return n_swa == 0 or pos <= n_swa or (pos - n_swa) % WINDOW_ALIGN == 0


def checkpoint_stops(start: int, n: int, chunk_size: int, every: int, n_swa: int = 0, hints: Sequence[int] = ()) -> list[int]:
    """Where to save the state while ``tokens[start:n]`` are evaluated (token counts, ascending).

    Every ``every``-th chunk boundary past ``start``; where the job's last chat message
    starts (``hints``, `worker.protocol.JobSpec.message_starts`: where the next request most
    likely parts from this one); and the prompt's end, the last position before its last
    two tokens (never kept, see `worker.prefix.keepable`). Off-boundary stops are stored as
    tail checkpoints. A window model stops only where it is `aligned` (a hint or the end
    moves back to such a position), and no piece between stops is a single token (a
    one-token batch comes out of other kernels).
    """
    c = chunk_size
    stops = {d * c for d in range(start // c + 1, (n - 2) // c + 1) if d % every == 0 and aligned(d * c, n_swa)}
    for want in [*hints, n - 2]:
        pos = want - (want - n_swa) % WINDOW_ALIGN if n_swa and want > n_swa else want
        if start < pos <= n - 2 and all(abs(pos - s) >= 2 for s in stops | {start}):
            stops.add(pos)
    return sorted(stops)


def evaluate_saving(llm: Llama, tokens: Sequence[int], start: int, stops: Sequence[int]) -> dict[int, Buffer]:
    """`evaluate_prompt` from ``start``, stopping after each of ``stops`` tokens to copy the whole state (tokens -> state)."""
    states: dict[int, Buffer] = {}
    pos = start
    for end in sorted(stops):
        evaluate_prompt(llm, tokens[:end], pos)
        states[end] = read_seq_state(llm)
        pos = end
    evaluate_prompt(llm, tokens, pos)
    return states


def restore_checkpoint(llm: Llama, state: Buffer, tokens: Sequence[int], n_swa: int = 0) -> None:
    """Load a whole-state checkpoint holding ``tokens``; raises `StateRestoreError` unless it ends at their last position
    and, for a window model (``n_swa``), its window starts `aligned`.

    The blob cannot be parsed here (llama.cpp's sliding-window and recurrent sections), so
    llama.cpp checks it: it must consume every byte, and the sequence must then end at
    position ``len(tokens) - 1``. The sequence is left empty on failure.
    """
    restore_seq_state(llm, state, tokens, check=False)
    first, end = seq_positions(llm)
    if end != len(tokens) - 1:
        clear_seq(llm)
        raise StateRestoreError(f"the checkpoint ends at position {end}, expected {len(tokens) - 1}")
    if n_swa and first % WINDOW_ALIGN:
        clear_seq(llm)
        raise StateRestoreError(f"the checkpoint's window starts at position {first}, not a multiple of {WINDOW_ALIGN}")
