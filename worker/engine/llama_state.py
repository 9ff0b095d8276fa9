"""Move one sequence's KV state in and out of a context, and evaluate prompts, through llama-cpp-python.

The byte layout of the state and how it is cut into chunks is :mod:`worker.cache.kvchunks`'s
business, the facts about a context's KV cache :mod:`worker.engine.kvcache`'s; this module
only moves blobs in and out of a context and decodes prompts into it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from functools import singledispatch
from typing import Any, TypeAlias

import llama_cpp
import numpy as np

from worker.engine.kvstate import Buffer, StateFormatError, describe_state, state_cell_count
from worker.engine.sequence import SeqView, cell_positions
from worker.errors import StateReadError, StateRestoreError

Llama: TypeAlias = llama_cpp.Llama | SeqView
"""A context of its own, or one sequence of a shared one (`worker.engine.sequence`).

Workers only ever hold views; a context of its own is what cold references, the
in-process bench and the tests open. The functions below that read or change a
sequence's cells are written once per kind (``functools.singledispatch``): for a
context of its own they call llama.cpp on sequence ``seq_id``; a view's is registered
beside it and goes through the view's loop (``seq_id`` is then the view's own, 0).
"""


def _neither(llm: object) -> TypeError:
    return TypeError(f"not a context or a sequence view: {type(llm).__name__}")


@singledispatch
def seq_positions(llm: Llama, seq_id: int = 0) -> tuple[int, int]:
    """The first and last position a sequence's cells hold (-1, -1 when none)."""
    raise _neither(llm)


@seq_positions.register
def _(llm: llama_cpp.Llama, seq_id: int = 0) -> tuple[int, int]:
    return cell_positions(llm.ctx, seq_id)


@seq_positions.register
def _(llm: SeqView, seq_id: int = 0) -> tuple[int, int]:
    return llm.positions()


def _state_window() -> Callable[[int, int], None] | None:
    """``llama_kvpool_state_window(p0, p1)`` of the loaded libllama (deploy/patches/state-window.patch), or None where it lacks it."""
    fn = getattr(llama_cpp.llama_cpp._lib, "llama_kvpool_state_window", None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = [ctypes.c_int32, ctypes.c_int32], None
    return fn  # type: ignore[no-any-return]


_WINDOW = _state_window()
_NO_END = 2**31 - 1


def readable_from(start: int) -> int:
    """Where a state read asked to begin at position ``start`` begins: there with kvpool's build, else at 0 (every cell)."""
    return start if _WINDOW is not None else 0


@singledispatch
def read_seq_state(llm: Llama, seq_id: int = 0, *, into: Callable[[int], bytearray] | None = None, start: int = 0) -> Buffer:
    """``llama_state_seq_get_data`` for one sequence (flags 0), as a single-stream blob (`worker.engine.sequence`).

    ``into(size)``: a buffer of at least ``size`` bytes to read into (`Publisher.buffer`); the result is then a view.
    ``start``: only the cells at positions from ``start`` on, a value of `readable_from` (a publisher
    wants the new chunks' cells, not the whole sequence's).
    """
    raise _neither(llm)


@read_seq_state.register
def _(llm: llama_cpp.Llama, seq_id: int = 0, *, into: Callable[[int], bytearray] | None = None, start: int = 0) -> Buffer:
    return read_ctx_state(llm.ctx, seq_id, into, start)  # type: ignore[no-any-return]


@read_seq_state.register
def _(llm: SeqView, seq_id: int = 0, *, into: Callable[[int], bytearray] | None = None, start: int = 0) -> Buffer:
    return llm.read_state(lambda ctx, seq, into: read_ctx_state(ctx, seq, into, start), into)  # type: ignore[no-any-return]


def read_ctx_state(ctx: Any, seq_id: int, into: Callable[[int], bytearray] | None = None, start: int = 0) -> Any:
    if start != readable_from(start):
        raise ValueError(f"this llama.cpp build reads whole sequences only, not from position {start}")
    if start:
        _WINDOW(start, _NO_END)  # type: ignore[misc]
    try:
        size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
        if size == 0:
            raise StateReadError(f"llama_state_seq_get_size failed for sequence {seq_id}")
        out = into(size) if into is not None else bytearray(size)
        target = (ctypes.c_uint8 * size).from_buffer(out)
        written = llama_cpp.llama_state_seq_get_data(ctx, target, size, seq_id)
        del target  # release the export, so the buffer is an ordinary bytearray again
    finally:
        if start:
            _WINDOW(-1, -1)  # type: ignore[misc]
    if written != size:
        raise StateReadError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
    return out if len(out) == size else memoryview(out)[:size]


@singledispatch
def clear_seq(llm: Llama, seq_id: int = 0) -> None:
    """Remove every cell of the sequence; for sequence 0 (or a view's own) also reset the wrapper's token record."""
    raise _neither(llm)


@clear_seq.register
def _(llm: llama_cpp.Llama, seq_id: int = 0) -> None:
    mem = llama_cpp.llama_get_memory(llm.ctx)
    if mem is not None:
        llama_cpp.llama_memory_seq_rm(mem, seq_id, -1, -1)
    if seq_id == 0:
        llm.n_tokens = 0
        llm._requires_eval = True  # generate() must decode before it samples


@clear_seq.register
def _(llm: SeqView, seq_id: int = 0) -> None:
    llm.clear()


def restore_seq_state(llm: Llama, state: Buffer, tokens: Sequence[int], seq_id: int = 0, *, check: bool = True) -> None:
    """Load ``state`` into sequence ``seq_id`` and record ``tokens`` as what it holds.

    The sequence is cleared first. llama.cpp returns the bytes it consumed and ignores
    trailing ones, and it accepts positions that do not start at 0, so anything but a
    full load raises :class:`StateRestoreError` with the sequence left empty. With
    ``check`` the blob is also parsed first: it must hold ``len(tokens)`` cells at
    positions ``0..len(tokens)-1``; pass ``check=False`` for blobs of caches
    :mod:`worker.cache.kvchunks` cannot parse (sliding-window, recurrent).

    ``Llama.eval`` removes every cell past ``llm.n_tokens`` before decoding, so for
    sequence 0 (the only one the wrapper tracks) ``n_tokens`` and ``input_ids`` are set
    to ``tokens``; the next ``eval`` then appends after them.
    """
    n = len(tokens)
    clear_seq(llm, seq_id)
    if n > llm.n_ctx():
        raise StateRestoreError(f"{n} tokens do not fit a context of {llm.n_ctx()}")
    if check:
        _check_blob(state, n)
    if n == 0:
        return

    load_seq_state(llm, state, tokens, seq_id, check=check)


@singledispatch
def load_seq_state(llm: Llama, state: Buffer, tokens: Sequence[int], seq_id: int = 0, *, check: bool = True) -> None:
    """Write a single-stream blob of ``len(tokens)`` cells into a cleared sequence and record ``tokens`` as what it holds.

    With ``check``, the cells must hold positions ``0..len(tokens)-1``; otherwise they are
    removed and `StateRestoreError` is raised. A view does all of it in one task of its
    engine loop, so its records change with its cells (`worker.engine.sequence.SeqView.write_state`).
    """
    raise _neither(llm)


@load_seq_state.register
def _(llm: llama_cpp.Llama, state: Buffer, tokens: Sequence[int], seq_id: int = 0, *, check: bool = True) -> None:
    n = len(tokens)
    write_ctx_state(llm.ctx, state, seq_id)
    if check:
        check_positions(llm.ctx, seq_id, n)
    if seq_id == 0:
        llm.input_ids[:n] = tokens
        llm.n_tokens = n


@load_seq_state.register
def _(llm: SeqView, state: Buffer, tokens: Sequence[int], seq_id: int = 0, *, check: bool = True) -> None:
    llm.write_state(write_ctx_state, state, tokens, check_positions if check else None)


def check_positions(ctx: Any, seq_id: int, n: int, source: str = "a restore") -> None:
    """Raise `StateRestoreError`, with the sequence's cells removed (none rather than a wrong one), unless they hold positions ``0..n-1``."""
    lo, hi = cell_positions(ctx, seq_id)
    if (lo, hi) != (0, n - 1):
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), seq_id, -1, -1)
        raise StateRestoreError(f"sequence {seq_id} holds positions {lo}..{hi} after {source}, expected 0..{n - 1}")


def write_ctx_state(ctx: Any, state: Buffer, seq_id: int) -> None:
    _keep_alive, src = _as_uint8_pointer(state)
    consumed = llama_cpp.llama_state_seq_set_data(ctx, src, len(state), seq_id)
    if consumed != len(state):
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), seq_id, -1, -1)
        raise StateRestoreError(
            f"llama_state_seq_set_data consumed {consumed} of {len(state)} bytes"
            + (" (rejected; see llama.cpp's log)" if consumed == 0 else " (trailing bytes)")
        )


def batch_sizes(n: int, n_batch: int) -> list[int]:
    """How to cut ``n`` prompt tokens into decode batches of at most ``n_batch``: never a lone last token.

    llama.cpp's CPU kernels for a one-token batch are not the ones it uses for larger
    batches, and their results differ in the last bits (logits move by up to ~0.5 on a
    trained model), while any batch of two or more tokens gives the same bits for every
    token whatever the split. So a prompt whose last batch held a single token would
    answer differently depending on how much was reused. Where the plain cut would leave
    one token last, the batch before it gives up one token instead.
    """
    if n_batch < 3:
        raise ValueError("n_batch must be at least 3")
    sizes = [n_batch] * (n // n_batch) + ([n % n_batch] if n % n_batch else [])
    if len(sizes) >= 2 and sizes[-1] == 1:
        sizes[-2:] = [n_batch - 1, 2]
    return sizes


def evaluate_prompt(llm: Llama, tokens: Sequence[int], start: int) -> None:
    """Decode ``tokens[start:]`` after the ``start`` cells the context holds, in `batch_sizes` batches.

    The context must hold ``tokens[:start]`` at positions ``0..start-1``; cells past
    ``start`` are removed. Afterwards the logits of the last token are fresh, so
    ``Llama.generate`` over the same tokens samples at once without decoding again.
    """
    if not 0 <= start < len(tokens):
        raise ValueError(f"start {start} outside the prompt of {len(tokens)} tokens")
    n_batch = _batch_limit(llm)
    llm.n_tokens = start
    pos = start
    for size in batch_sizes(len(tokens) - start, n_batch):
        llm.eval(tokens[pos : pos + size])
        pos += size


@singledispatch
def evaluate_all_logits(llm: Llama, tokens: Sequence[int]) -> Iterator[tuple[int, np.ndarray]]:
    """Decode ``tokens`` from an empty context with the logits of every position; yields (first position, logits) per batch.

    The logits are a view into llama.cpp's buffer (a view's: its own copy), valid until the next batch is decoded.
    """
    raise _neither(llm)


@evaluate_all_logits.register
def _(llm: llama_cpp.Llama, tokens: Sequence[int]) -> Iterator[tuple[int, np.ndarray]]:
    n_vocab = llm.n_vocab()
    n_batch = _batch_limit(llm)
    llm.n_tokens = 0
    llm._ctx.kv_cache_seq_rm(-1, 0, -1)  # as Llama.eval does before it decodes
    pos = 0
    for size in batch_sizes(len(tokens), n_batch):
        batch = list(tokens[pos : pos + size])
        llm._batch.set_batch(batch=batch, n_past=pos, logits_all=True)
        llm._ctx.decode(llm._batch)
        yield pos, np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(size, n_vocab))
        llm.input_ids[pos : pos + size] = batch
        llm.n_tokens = pos + size
        pos += size
    llm._requires_eval = False


@evaluate_all_logits.register
def _(llm: SeqView, tokens: Sequence[int]) -> Iterator[tuple[int, np.ndarray]]:
    llm.n_tokens = 0
    for size in batch_sizes(len(tokens), _batch_limit(llm)):
        pos = llm.n_tokens
        yield pos, llm.decode_rows(tokens[pos : pos + size])


@singledispatch
def last_logits(llm: Llama) -> np.ndarray:
    """A copy of the logits of the last decoded token (float32, one per vocabulary entry)."""
    raise _neither(llm)


@last_logits.register
def _(llm: llama_cpp.Llama) -> np.ndarray:
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


@last_logits.register
def _(llm: SeqView) -> np.ndarray:
    return llm.logits.copy()


def is_end_of_generation(llm: Llama, token: int) -> bool:
    return bool(llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), token))


def _batch_limit(llm: Llama) -> int:
    """The most tokens one decode call of ``llm`` takes (its batch, at most one micro-batch)."""
    return min(llm.n_batch, int(llm.context_params.n_ubatch))


def _check_blob(state: Buffer, n_tokens: int) -> None:
    try:
        if n_tokens == 0:
            if state_cell_count(state) != 0:
                raise StateRestoreError("a non-empty state was given with no tokens")
            return
        info = describe_state(state)
    except StateFormatError as e:
        raise StateRestoreError(f"not a loadable single-sequence state: {e}") from e
    if info.n_cells != n_tokens:
        raise StateRestoreError(f"state holds {info.n_cells} cells for {n_tokens} tokens")
    if not (info.contiguous and info.pos_min == 0):
        raise StateRestoreError(f"state positions are not 0..{n_tokens - 1}")


def _as_uint8_pointer(state: Buffer) -> tuple[object, Any]:
    """A ``uint8_t *`` to the blob without copying it where possible, and what keeps it alive."""
    if isinstance(state, bytes):
        return state, ctypes.cast(ctypes.c_char_p(state), ctypes.POINTER(ctypes.c_uint8))
    view = memoryview(state).cast("B")
    if view.readonly or not view.c_contiguous:
        arr = (ctypes.c_uint8 * len(view)).from_buffer_copy(view)
    else:
        arr = (ctypes.c_uint8 * len(view)).from_buffer(view)
    return arr, ctypes.cast(arr, ctypes.POINTER(ctypes.c_uint8))
