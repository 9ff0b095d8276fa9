"""Facts about a context's KV cache: its cell types, its layout, and whether its state can be cut into shared chunks.

Read once per context (`context_cache`) and passed along: they decide the namespace a
chunk is stored under (`worker.cache.namespace`), how `worker.cache.kvchunks` cuts and joins state,
and whether a memory is shared as cells or as whole checkpoints (`worker.cache.checkpoints`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llama_cpp

from worker.engine.kvstate import (
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
    CellFormat,
)

if TYPE_CHECKING:
    from worker.engine.sequence import SeqView

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
    """Not cuttable, but stored whole at chunk boundaries (`worker.cache.checkpoints`): window, recurrent, hybrid memories."""

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


def context_cache(llm: llama_cpp.Llama | SeqView) -> ContextCache:
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
