"""Whole-state checkpoints on the worker: saving them while a prompt is evaluated, restoring one, and proving it exact.

For memories that cannot be cut into per-token cells (`worker.llama_state.ContextCache`,
``checkpoints``): a sliding-window cache holds only the window's cells in its second
section, a recurrent memory one fixed block per sequence, a hybrid both. The state after
the first ``k`` chunks depends on those tokens alone, so a worker evaluating a prompt stops
at chunk boundaries, copies the whole sequence state (``llama_state_seq_get_data``) and
publishes it under the boundary's chain key (`store.checkpoints`). Another worker
restores the deepest checkpoint on a prompt's chain and evaluates the rest.

The exactness rules are those of cells. Every piece evaluated is at least two tokens
(boundaries are whole chunks apart, and the last two prompt tokens are always evaluated
together), so each token comes out of the batched kernels whatever the split, and the
start-up check (`worker.selfcheck.check_checkpoint`) proves on this model and CPU that a checkpoint
restored and continued gives the cold evaluation's logits to the bit. A worker whose check
fails serves cold.
"""

from __future__ import annotations

from collections.abc import Sequence

import llama_cpp

from worker.kvstate import Buffer
from worker.llama_state import Llama, StateRestoreError, clear_seq, evaluate_prompt, read_seq_state, restore_seq_state
from worker.sequence import SeqView


def checkpoint_depths(start: int, n: int, chunk_size: int, every: int) -> list[int]:
    """The chunk counts at which to save the state while ``tokens[start:n]`` are evaluated.

    Every ``every``-th chunk boundary past ``start`` that leaves at least two tokens to
    evaluate after it (the last two are never kept, see `worker.prefix.keepable`).
    """
    first = start // chunk_size + 1
    return [d for d in range(first, (n - 2) // chunk_size + 1) if d % every == 0]


def evaluate_saving(llm: Llama, tokens: Sequence[int], start: int, depths: Sequence[int], chunk_size: int) -> dict[int, bytearray]:
    """`evaluate_prompt` from ``start``, stopping at each depth's boundary to copy the whole state (depth -> state)."""
    states: dict[int, bytearray] = {}
    pos = start
    for depth in depths:
        end = depth * chunk_size
        evaluate_prompt(llm, tokens[:end], pos)
        states[depth] = read_seq_state(llm)
        pos = end
    evaluate_prompt(llm, tokens, pos)
    return states


def restore_checkpoint(llm: Llama, state: Buffer, tokens: Sequence[int]) -> None:
    """Load a whole-state checkpoint holding ``tokens``; raises `StateRestoreError` unless it ends at their last position.

    The blob cannot be parsed here (llama.cpp's sliding-window and recurrent sections), so
    llama.cpp checks it: it must consume every byte, and the sequence must then end at
    position ``len(tokens) - 1``. The sequence is left empty on failure.
    """
    restore_seq_state(llm, state, tokens, check=False)
    ctx, seq = (llm.batcher.llm.ctx, llm.seq) if isinstance(llm, SeqView) else (llm.ctx, 0)
    mem = llama_cpp.llama_get_memory(ctx)
    end = llama_cpp.llama_memory_seq_pos_max(mem, seq)
    if end != len(tokens) - 1:
        clear_seq(llm)
        raise StateRestoreError(f"the checkpoint ends at position {end}, expected {len(tokens) - 1}")
