"""Read and restore one sequence's KV state through llama-cpp-python's low-level bindings.

The byte layout of the state and how it is cut into chunks is :mod:`worker.kvchunks`'s
business; this module only moves blobs in and out of a ``llama_cpp.Llama`` and reports
the facts about its KV cache that decide whether and how chunks may be shared.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import llama_cpp
import numpy as np

from worker.errors import StateReadError, StateRestoreError
from worker.kvstate import (
    GGML_BLOCKS,
    GGML_TYPE_BF16,
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    GGML_TYPE_IQ4_NL,
    GGML_TYPE_Q4_0,
    GGML_TYPE_Q4_1,
    GGML_TYPE_Q5_0,
    GGML_TYPE_Q5_1,
    GGML_TYPE_Q8_0,
    Buffer,
    CellFormat,
    StateFormatError,
    describe_state,
    state_cell_count,
)
from worker.sequence import SeqView

Llama: TypeAlias = llama_cpp.Llama | SeqView
"""A context of its own, or one sequence of a shared one (`worker.sequence`)."""

CACHE_TYPES: dict[str, int] = {
    "f32": GGML_TYPE_F32,
    "f16": GGML_TYPE_F16,
    "bf16": GGML_TYPE_BF16,
    "q8_0": GGML_TYPE_Q8_0,
    "q4_0": GGML_TYPE_Q4_0,
    "q4_1": GGML_TYPE_Q4_1,
    "q5_0": GGML_TYPE_Q5_0,
    "q5_1": GGML_TYPE_Q5_1,
    "iq4_nl": GGML_TYPE_IQ4_NL,
}
CACHE_TYPE_NAMES = {v: k for k, v in CACHE_TYPES.items()}

ATTN_ROT_ENV = "LLAMA_ATTN_ROT_DISABLE"
"""llama.cpp reads this when it creates a context; it changes the bytes of a quantized cache."""


def attn_rot_disabled() -> bool:
    """``LLAMA_ATTN_ROT_DISABLE`` read as llama.cpp does (``atoi``): unset, empty, 0 or text leave rotation on."""
    m = re.match(r"\s*([+-]?\d+)", os.environ.get(ATTN_ROT_ENV, ""))
    return bool(m and int(m.group(1)))


def cache_type_id(cache_type: str | int) -> int:
    """The ggml type id of a KV cache type given by name (``"f16"``, ``"q8_0"``, ...) or id."""
    if isinstance(cache_type, int):
        if cache_type not in CACHE_TYPE_NAMES:
            raise ValueError(f"unsupported KV cache type id {cache_type}")
        return cache_type
    try:
        return CACHE_TYPES[cache_type.lower()]
    except KeyError:
        raise ValueError(f"unsupported KV cache type {cache_type!r}; one of {sorted(CACHE_TYPES)}") from None


def is_quantized(ggml_type: int) -> bool:
    return GGML_BLOCKS[ggml_type][0] > 1


def seq_positions(llm: Llama, seq_id: int = 0) -> tuple[int, int]:
    """The first and last position a sequence's cells hold (-1, -1 when none); a view's read on its loop."""
    if isinstance(llm, SeqView):
        return llm.positions()
    mem = llama_cpp.llama_get_memory(llm.ctx)
    return int(llama_cpp.llama_memory_seq_pos_min(mem, seq_id)), int(llama_cpp.llama_memory_seq_pos_max(mem, seq_id))


@dataclass(frozen=True)
class ContextCache:
    """Facts about a context's KV cache that decide whether (and under which key) state can be shared."""

    type_k: int
    type_v: int
    flash_attn: bool
    n_layer: int
    n_embd_k_gqa: int
    n_embd_v_gqa: int
    attn_rot_k: bool
    attn_rot_v: bool
    """Hadamard rotation of a quantized cache (off under ``LLAMA_ATTN_ROT_DISABLE``): it changes the bytes."""
    cuttable: bool
    """The sequence state is one plain KV cache section that can be cut by position."""
    reason: str | None
    """Why it cannot be cut, when it cannot."""
    prefix_reuse: bool = True
    """The context can be cut back to a prefix of what it holds (recurrent and hybrid memories cannot)."""
    n_swa: int = 0
    """Tokens a sliding-window layer attends to (0: none)."""
    checkpoints: bool = False
    """Not cuttable, but stored whole at chunk boundaries (`worker.checkpoints`): window, recurrent, hybrid memories."""

    @property
    def v_trans(self) -> bool:
        return not self.flash_attn

    @property
    def state_layout(self) -> CellFormat:
        """The expected per-token layout, assuming every layer has the same K/V width."""
        return CellFormat.uniform(self.n_layer, self.n_embd_k_gqa, self.n_embd_v_gqa, self.type_k, self.type_v)

    @property
    def bytes_per_token(self) -> int:
        return self.state_layout.bytes_per_token


def context_cache(llm: Llama) -> ContextCache:
    """The KV layout of ``llm``'s context.

    ``attn_rot_*`` reflect ``LLAMA_ATTN_ROT_DISABLE`` as it is now; llama.cpp read it when
    the context was created, so do not change it in between.
    """
    model, params = llm.model, llm.context_params
    n_head = llama_cpp.llama_model_n_head(model)
    n_head_kv = llama_cpp.llama_model_n_head_kv(model)
    arch = llm.metadata.get("general.architecture", "")
    default_head = llama_cpp.llama_model_n_embd(model) // max(n_head, 1)
    head_k = int(llm.metadata.get(f"{arch}.attention.key_length", default_head))
    head_v = int(llm.metadata.get(f"{arch}.attention.value_length", default_head))
    type_k, type_v = int(params.type_k), int(params.type_v)
    flash_attn = params.flash_attn_type != llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    rot_disabled = attn_rot_disabled()

    reason, whole = None, True
    rope_type = llama_cpp.llama_model_rope_type(model)
    recurrent, hybrid = llama_cpp.llama_model_is_recurrent(model), llama_cpp.llama_model_is_hybrid(model)
    if recurrent:
        reason = "recurrent state is one fixed block per sequence"
    elif hybrid:
        reason = "hybrid attention/recurrent memory"
    elif llama_cpp.llama_model_n_swa(model) > 0:
        reason = "sliding-window cache keeps only the window and writes a second section"
    if llama_cpp.llama_model_has_encoder(model):
        reason, whole = "encoder-decoder model", False
    elif rope_type in (
        llama_cpp.LLAMA_ROPE_TYPE_MROPE,
        llama_cpp.LLAMA_ROPE_TYPE_IMROPE,
        llama_cpp.LLAMA_ROPE_TYPE_VISION,
    ):
        reason, whole = "multi-dimensional positions are not one per token", False

    return ContextCache(
        type_k=type_k,
        type_v=type_v,
        flash_attn=flash_attn,
        n_layer=llama_cpp.llama_model_n_layer(model),
        n_embd_k_gqa=n_head_kv * head_k,
        n_embd_v_gqa=n_head_kv * head_v,
        attn_rot_k=not rot_disabled and type_k in GGML_BLOCKS and is_quantized(type_k) and head_k % 64 == 0,
        attn_rot_v=not rot_disabled and type_v in GGML_BLOCKS and is_quantized(type_v) and head_v % 64 == 0,
        cuttable=reason is None,
        reason=reason,
        prefix_reuse=not (recurrent or hybrid),
        n_swa=max(0, int(llama_cpp.llama_model_n_swa(model))),
        checkpoints=reason is not None and whole,
    )


def read_seq_state(llm: Llama, seq_id: int = 0, *, into: Callable[[int], bytearray] | None = None) -> Buffer:
    """``llama_state_seq_get_data`` for one sequence (flags 0), as a single-stream blob (`worker.sequence`).

    ``into(size)``: a buffer of at least ``size`` bytes to read into (`Publisher.buffer`); the result is then a view.
    """
    if isinstance(llm, SeqView):
        return llm.read_state(read_ctx_state, into)  # type: ignore[no-any-return]
    return read_ctx_state(llm.ctx, seq_id, into)  # type: ignore[no-any-return]


def read_ctx_state(ctx: Any, seq_id: int, into: Callable[[int], bytearray] | None = None) -> Any:
    size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
    if size == 0:
        raise StateReadError(f"llama_state_seq_get_size failed for sequence {seq_id}")
    out = into(size) if into is not None else bytearray(size)
    target = (ctypes.c_uint8 * size).from_buffer(out)
    written = llama_cpp.llama_state_seq_get_data(ctx, target, size, seq_id)
    del target  # release the export, so the buffer is an ordinary bytearray again
    if written != size:
        raise StateReadError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
    return out if len(out) == size else memoryview(out)[:size]


def clear_seq(llm: Llama, seq_id: int = 0) -> None:
    """Remove every cell of the sequence; for sequence 0 (or a view's own) also reset the wrapper's token record."""
    if isinstance(llm, SeqView):
        llm.clear()
        return
    mem = llama_cpp.llama_get_memory(llm.ctx)
    if mem is not None:
        llama_cpp.llama_memory_seq_rm(mem, seq_id, -1, -1)
    if seq_id == 0:
        llm.n_tokens = 0
        llm._requires_eval = True  # generate() must decode before it samples


def restore_seq_state(llm: Llama, state: Buffer, tokens: Sequence[int], seq_id: int = 0, *, check: bool = True) -> None:
    """Load ``state`` into sequence ``seq_id`` and record ``tokens`` as what it holds.

    The sequence is cleared first. llama.cpp returns the bytes it consumed and ignores
    trailing ones, and it accepts positions that do not start at 0, so anything but a
    full load raises :class:`StateRestoreError` with the sequence left empty. With
    ``check`` the blob is also parsed first: it must hold ``len(tokens)`` cells at
    positions ``0..len(tokens)-1``; pass ``check=False`` for blobs of caches
    :mod:`worker.kvchunks` cannot parse (sliding-window, recurrent).

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

    if isinstance(llm, SeqView):
        llm.write_state(write_ctx_state, state)
    else:
        write_ctx_state(llm.ctx, state, seq_id)
    if check:
        lo, hi = seq_positions(llm, seq_id)
        if (lo, hi) != (0, n - 1):
            clear_seq(llm, seq_id)
            raise StateRestoreError(f"restored positions {lo}..{hi}, expected 0..{n - 1}")
    if seq_id == 0 or isinstance(llm, SeqView):
        llm.input_ids[:n] = tokens
        llm.n_tokens = n


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
    n_batch = min(llm.n_batch, int(llm.context_params.n_ubatch))
    llm.n_tokens = start
    pos = start
    for size in batch_sizes(len(tokens) - start, n_batch):
        llm.eval(tokens[pos : pos + size])
        pos += size


def evaluate_all_logits(llm: Llama, tokens: Sequence[int]) -> Iterator[tuple[int, np.ndarray]]:
    """Decode ``tokens`` from an empty context with the logits of every position; yields (first position, logits) per batch.

    The logits are a view into llama.cpp's buffer, valid until the next batch is decoded.
    """
    n_vocab = llm.n_vocab()
    n_batch = min(llm.n_batch, int(llm.context_params.n_ubatch))
    llm.n_tokens = 0
    if isinstance(llm, SeqView):
        for size in batch_sizes(len(tokens), n_batch):
            pos = llm.n_tokens
            yield pos, llm.decode_rows(tokens[pos : pos + size])
        return
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


def last_logits(llm: Llama) -> np.ndarray:
    """A copy of the logits of the last decoded token (float32, one per vocabulary entry)."""
    if isinstance(llm, SeqView):
        return llm.logits.copy()
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def is_end_of_generation(llm: Llama, token: int) -> bool:
    return bool(llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), token))


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
