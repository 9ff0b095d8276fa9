"""Whole-state checkpoints on the worker: saving them while a prompt is evaluated, restoring one, and proving it exact.

For memories that cannot be cut into per-token cells (`worker.engine.kvcache.ContextCache`,
``checkpoints``): a sliding-window cache holds only the window's cells in its second
section, a recurrent memory one fixed block per sequence, a hybrid both. The state after
the first ``k`` chunks depends on those tokens alone, so a worker evaluating a prompt stops
at chunk boundaries (spaced out along the prompt: `spaced`), copies the whole sequence state (``llama_state_seq_get_data``) and
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
start-up check (`worker.startup.selfcheck.check_checkpoint`) proves on this model and CPU that a checkpoint
restored and continued gives the cold evaluation's logits to the bit. A worker whose check
fails serves cold.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.kvstate import Buffer
from worker.engine.llama_state import Llama, StateRestoreError, clear_seq, evaluate_prompt, read_seq_state, restore_seq_state, seq_positions

WINDOW_ALIGN = 32
"""A window model's checkpoint is taken only where its window starts at a multiple of this (see above)."""


def aligned(pos: int, n_swa: int) -> bool:
    """Whether a checkpoint after ``pos`` tokens restores with the cold bits: its window (the last ``n_swa``) starts aligned."""
    return n_swa == 0 or pos <= n_swa or (pos - n_swa) % WINDOW_ALIGN == 0


STOPS_PER_DOUBLING = 4
"""Boundary checkpoints kept between a position and twice it, past the first ones (`spaced`)."""


def spaced(d: int, every: int) -> bool:
    """Whether the chunk boundary after ``d`` chunks takes a checkpoint: densely near the start, geometrically further out.

    Counted in units of ``every`` chunks, the first 2 × `STOPS_PER_DOUBLING` units each take
    one, then each doubling of the position takes `STOPS_PER_DOUBLING`, evenly spaced (with
    4: units 1 to 8, then 10, 12, 14, 16, 20, 24, 28, 32, 40, ...). A checkpoint holds the
    whole state, whose size grows with its position for a model with global attention
    layers beside its window (Gemma 3), so evenly spaced boundaries store bytes quadratic in
    a prompt's length; these store a bounded multiple of the deepest one's, in a number of
    blobs logarithmic in the length. Near the start, where system prompts and tool lists
    are shared by many sessions, they stay dense. The set depends on the position alone:
    every worker picks the same boundaries, and lookups find them.
    """
    if d <= 0 or d % every:
        return False
    m = d // every
    step = max(1, (1 << (m.bit_length() - 1)) // STOPS_PER_DOUBLING)
    return m % step == 0


def checkpoint_stops(start: int, n: int, chunk_size: int, every: int, n_swa: int = 0, hints: Sequence[int] = ()) -> list[int]:
    """Where to save the state while ``tokens[start:n]`` are evaluated (token counts, ascending).

    The chunk boundaries past ``start`` that are `spaced` (dense near the start,
    geometric further out); where the job's last chat message starts (``hints``,
    `worker.protocol.JobSpec.message_starts`: where the next request most likely parts
    from this one); and always the prompt's end, the last position before its last two
    tokens (never kept, see `worker.cache.prefix.keepable`): what the next turn of a chat,
    which resends the whole history, resumes from. Off-boundary stops are stored as tail
    checkpoints, and a newer one of the same prompt supersedes the older ones
    (`store.checkpoints.Checkpoints.supersede`), so a long session stores a bounded number
    of bytes; a hint or end that falls on a boundary not `spaced` moves back off it (one
    token, or one window alignment, unless chunks are that small), or it would be stored as a
    boundary, never superseded. A window model stops only where it is `aligned` (a hint or the end moves
    back to such a position), and no piece between stops is a single token (a one-token
    batch comes out of other kernels).
    """
    c = chunk_size
    stops = {d * c for d in range(start // c + 1, (n - 2) // c + 1) if spaced(d, every) and aligned(d * c, n_swa)}
    for want in [*hints, n - 2]:
        pos = want - (want - n_swa) % WINDOW_ALIGN if n_swa and want > n_swa else want
        step = WINDOW_ALIGN if n_swa and pos > n_swa else 1
        if pos % c == 0 and not spaced(pos // c, every) and (pos - step) % c:  # a tail, which a later turn supersedes
            pos -= step
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
