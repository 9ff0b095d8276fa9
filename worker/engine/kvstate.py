"""The sequence-state blob llama.cpp writes and reads for one sequence: its format, layouts and parser.

The blob (``llama_state_seq_get_data(ctx, buf, size, seq_id)``, flags 0, a plain
``llama_kv_cache`` with one stream), as written by llama-cpp-python 0.3.36's vendored
llama.cpp (``llama_context::state_seq_get_data``, ``llama_kv_cache::state_write``,
``state_write_meta``, ``state_write_data``). Little-endian, packed, no padding::

    u32 magic = 0xAF143CD8
    i32 seq_id                       ignored on load
    u32 n_stream                     must equal the target context's; we only handle 1
    u32 n_cells                      0: the blob ends here
    n_cells x cell metadata          i32 pos, u32 n_seq_id (= 1), [12 bytes ext], i32 seq_id
    u32 v_trans, u32 n_layer
    n_layer x K section              i32 type, u64 row_bytes, n_cells rows
    n_layer x V section, v_trans=0   i32 type, u64 row_bytes, n_cells rows
    n_layer x V section, v_trans=1   i32 type, u32 el_size, u32 n_embd_v_gqa,
                                     n_embd_v_gqa x n_cells elements (dimension-major)

``ext`` (x, y, tok) is present only for M-RoPE or per-layer-embedding models; nothing
in the blob says so, so it is detected by which stride makes the whole blob parse. The
cells appear in cache-cell order, which after removals and reuse is not position order.

`CellFormat` is what one token of such a state looks like, whatever the V layout; it
also writes the header of `worker.cache.kvchunks`' chunk payloads, which carry it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from worker.errors import StateFormatError

Buffer: TypeAlias = bytes | bytearray | memoryview

STATE_MAGIC = 0xAF143CD8
PAYLOAD_MAGIC = b"KVCL"
PAYLOAD_VERSION = 2

CELL_META_BYTES = 12
"""``i32 pos, u32 n_seq_id, i32 seq_id`` for a cell that belongs to one sequence."""
CELL_EXT_BYTES = 12
"""``llama_kv_cell_ext``: ``i32 x, i32 y, i32 tok``."""

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_Q4_0 = 2
GGML_TYPE_Q4_1 = 3
GGML_TYPE_Q5_0 = 6
GGML_TYPE_Q5_1 = 7
GGML_TYPE_Q8_0 = 8
GGML_TYPE_IQ4_NL = 20
GGML_TYPE_BF16 = 30

GGML_BLOCKS: dict[int, tuple[int, int]] = {
    GGML_TYPE_F32: (1, 4),
    GGML_TYPE_F16: (1, 2),
    GGML_TYPE_BF16: (1, 2),
    GGML_TYPE_Q4_0: (32, 18),
    GGML_TYPE_Q4_1: (32, 20),
    GGML_TYPE_Q5_0: (32, 22),
    GGML_TYPE_Q5_1: (32, 24),
    GGML_TYPE_Q8_0: (32, 34),
    GGML_TYPE_IQ4_NL: (32, 18),
}
"""(elements per block, bytes per block) of the ggml types llama.cpp allows for a KV cache."""

_STATE_HEAD = struct.Struct("<IiII")  # magic, seq_id, n_stream, n_cells
_DATA_HEAD = struct.Struct("<II")  # v_trans, n_layer
_ROW_HEAD = struct.Struct("<iQ")  # type, row_bytes (K, and V when v_trans == 0)
_VT_HEAD = struct.Struct("<iII")  # type, el_size, n_embd_v_gqa (V when v_trans == 1)
_PAYLOAD_HEAD = struct.Struct("<4sHHII")
_LAYER_DESC = struct.Struct("<iIiI")
_MAX_LAYERS = 4096

_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def ggml_row_bytes(ggml_type: int, n_elements: int) -> int:
    """Bytes of one row of ``n_elements`` values of a KV-cache ggml type (``ggml_row_size``)."""
    try:
        block, size = GGML_BLOCKS[ggml_type]
    except KeyError:
        raise ValueError(f"unsupported KV cache ggml type {ggml_type}") from None
    if n_elements % block:
        raise ValueError(f"{n_elements} elements do not fill blocks of {block} (type {ggml_type})")
    return n_elements // block * size


@dataclass(frozen=True)
class LayerFormat:
    k_type: int
    k_row_bytes: int
    v_type: int
    v_row_bytes: int


@dataclass(frozen=True)
class CellFormat:
    """What one token of a sequence's KV state looks like, independent of the V layout."""

    layers: tuple[LayerFormat, ...]
    cell_meta_bytes: int = CELL_META_BYTES

    @classmethod
    def uniform(
        cls,
        n_layer: int,
        n_embd_k_gqa: int,
        n_embd_v_gqa: int,
        type_k: int = GGML_TYPE_F16,
        type_v: int = GGML_TYPE_F16,
        cell_meta_bytes: int = CELL_META_BYTES,
    ) -> CellFormat:
        """The layout of a model whose layers all share one K and one V width."""
        layer = LayerFormat(type_k, ggml_row_bytes(type_k, n_embd_k_gqa), type_v, ggml_row_bytes(type_v, n_embd_v_gqa))
        return cls((layer,) * n_layer, cell_meta_bytes)

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_token(self) -> int:
        return self.cell_meta_bytes + sum(lay.k_row_bytes + lay.v_row_bytes for lay in self.layers)

    @property
    def header_bytes(self) -> int:
        return _PAYLOAD_HEAD.size + self.n_layer * _LAYER_DESC.size

    def payload_bytes(self, n_cells: int) -> int:
        return self.header_bytes + n_cells * self.bytes_per_token

    def state_bytes(self, n_cells: int) -> int:
        """Size of llama.cpp's blob for ``n_cells`` cells (the same for either V layout)."""
        if n_cells == 0:
            return _STATE_HEAD.size
        sections = self.n_layer * (_ROW_HEAD.size + _ROW_HEAD.size)  # _VT_HEAD is also 12 bytes
        return _STATE_HEAD.size + _DATA_HEAD.size + sections + n_cells * self.bytes_per_token

    def _header(self, n_cells: int) -> bytes:
        head = _PAYLOAD_HEAD.pack(PAYLOAD_MAGIC, PAYLOAD_VERSION, self.cell_meta_bytes, n_cells, self.n_layer)
        return head + b"".join(_LAYER_DESC.pack(lay.k_type, lay.k_row_bytes, lay.v_type, lay.v_row_bytes) for lay in self.layers)

    def _field_offsets(self) -> list[tuple[int, int]]:
        """Offsets of each layer's K and V row inside a token record."""
        offsets, at = [], self.cell_meta_bytes
        for lay in self.layers:
            offsets.append((at, at + lay.k_row_bytes))
            at += lay.k_row_bytes + lay.v_row_bytes
        return offsets


@dataclass(frozen=True)
class StateInfo:
    """What :func:`describe_state` found in a blob."""

    layout: CellFormat
    n_cells: int
    v_trans: bool
    seq_id: int
    pos_min: int
    pos_max: int
    in_order: bool
    """Cells are stored in position order, each position once, no gaps."""
    contiguous: bool
    """Positions are exactly ``pos_min..pos_max``, each once (in any cell order)."""


@dataclass(frozen=True)
class _Parsed:
    """Byte offsets of every section of a blob; the arrays are views into it."""

    layout: CellFormat
    n_cells: int
    v_trans: bool
    seq_id: int
    meta: np.ndarray  # (n_cells, cell_meta_bytes) uint8
    keys: tuple[np.ndarray, ...]  # per layer (n_cells, k_row_bytes) uint8
    values: tuple[np.ndarray, ...]  # per layer (n_cells, v_row_bytes) uint8, or (n_cells, n_embd) uint{el}
    positions: np.ndarray


def state_cell_count(state: Buffer) -> int:
    """Number of cells in a blob, from its header alone."""
    return _state_head(state)[3]


def describe_state(state: Buffer) -> StateInfo:
    """Parse a blob's structure (not its K/V values) and report its layout and positions."""
    p = _parse_state(state)
    if p.n_cells == 0:
        raise StateFormatError("the state holds no cells")
    pos = p.positions
    pos_min, pos_max = int(pos.min()), int(pos.max())
    in_order = bool(np.array_equal(pos, np.arange(pos_min, pos_min + p.n_cells)))
    contiguous = in_order or (pos_max - pos_min + 1 == p.n_cells and bool(np.array_equal(np.sort(pos), np.arange(pos_min, pos_max + 1))))
    return StateInfo(p.layout, p.n_cells, p.v_trans, p.seq_id, pos_min, pos_max, in_order, contiguous)


def as_sequence_zero(state: bytearray | memoryview) -> None:
    """Rewrite, in place, the sequence id of a blob and of each of its cells to 0 (llama.cpp discards them on load).

    A chunk then has the same bytes whichever sequence of a multi-sequence context it was
    read from (`worker.engine.sequence`). A blob this module cannot parse is left as it is.
    """
    try:
        p = _parse_state(state)
    except StateFormatError:
        return
    struct.pack_into("<i", state, 4, 0)
    if p.n_cells:
        p.meta[:, -4:] = 0


def _transposable_el_size(v_type: int) -> int:
    """Element size of a V type llama.cpp can store transposed (plain floats only)."""
    if v_type not in (GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16):
        raise StateFormatError(f"V type {v_type} cannot be stored transposed (quantized V needs flash attention)")
    return GGML_BLOCKS[v_type][1]


def _state_head(state: Buffer) -> tuple[int, int, int, int]:
    if len(state) < _STATE_HEAD.size:
        raise StateFormatError(f"state is truncated: {len(state)} bytes")
    magic, seq_id, n_stream, n_cells = _STATE_HEAD.unpack_from(state, 0)
    if magic != STATE_MAGIC:
        raise StateFormatError(f"bad state magic {magic:#010x}")
    if n_stream != 1:
        raise StateFormatError(f"state has {n_stream} streams; only single-stream caches can be cut")
    return magic, seq_id, n_stream, n_cells


def _parse_state(state: Buffer) -> _Parsed:
    _, seq_id, _, n_cells = _state_head(state)
    if n_cells == 0:
        if len(state) != _STATE_HEAD.size:
            raise StateFormatError("an empty state has trailing bytes")
        empty = np.empty((0,), np.int32)
        return _Parsed(CellFormat(()), 0, False, seq_id, empty, (), (), empty)
    # Whether cells carry the 12-byte ext is not recorded: try both strides and keep the one that
    # accounts for every byte of the blob.
    errors: list[str] = []
    parsed: list[_Parsed] = []
    for meta_bytes in (CELL_META_BYTES, CELL_META_BYTES + CELL_EXT_BYTES):
        try:
            parsed.append(_parse_sections(state, seq_id, n_cells, meta_bytes))
        except StateFormatError as e:
            errors.append(str(e))
    if len(parsed) != 1:
        raise StateFormatError(errors[0] if not parsed else "state parses both with and without cell ext")
    return parsed[0]


def _parse_sections(state: Buffer, seq_id: int, n: int, meta_bytes: int) -> _Parsed:
    size = len(state)

    def need(at: int, nbytes: int, what: str) -> None:
        if at + nbytes > size:
            raise StateFormatError(f"state is truncated in {what} (needs {at + nbytes} bytes, has {size})")

    at = _STATE_HEAD.size
    need(at, n * meta_bytes + _DATA_HEAD.size, "cell metadata")
    meta = np.ndarray((n, meta_bytes), np.uint8, state, at)
    n_seq_id = np.ndarray((n,), "<u4", state, at + 4, (meta_bytes,))
    if not np.all(n_seq_id == 1):
        raise StateFormatError("a cell does not belong to exactly one sequence (n_seq_id != 1)")
    positions = np.ndarray((n,), "<i4", state, at, (meta_bytes,))
    at += n * meta_bytes

    v_trans, n_layer = _DATA_HEAD.unpack_from(state, at)
    if v_trans not in (0, 1) or not 0 < n_layer <= _MAX_LAYERS:
        raise StateFormatError(f"implausible v_trans={v_trans} n_layer={n_layer}")
    at += _DATA_HEAD.size

    k_descs, keys = [], []
    for il in range(n_layer):
        need(at, _ROW_HEAD.size, f"K header of layer {il}")
        k_type, row = _ROW_HEAD.unpack_from(state, at)
        at += _ROW_HEAD.size
        if not 0 < row < 1 << 32:
            raise StateFormatError(f"implausible K row size {row} in layer {il}")
        need(at, n * row, f"K of layer {il}")
        keys.append(np.ndarray((n, row), np.uint8, state, at))
        k_descs.append((k_type, row))
        at += n * row

    v_descs, values = [], []
    for il in range(n_layer):
        need(at, _ROW_HEAD.size, f"V header of layer {il}")
        if not v_trans:
            v_type, row = _ROW_HEAD.unpack_from(state, at)
            at += _ROW_HEAD.size
            if not 0 < row < 1 << 32:
                raise StateFormatError(f"implausible V row size {row} in layer {il}")
            need(at, n * row, f"V of layer {il}")
            values.append(np.ndarray((n, row), np.uint8, state, at))
        else:
            v_type, el, n_embd = _VT_HEAD.unpack_from(state, at)
            at += _VT_HEAD.size
            if el != _transposable_el_size(v_type):
                raise StateFormatError(f"V element size {el} does not match type {v_type} in layer {il}")
            row = el * n_embd
            need(at, n * row, f"V of layer {il}")
            values.append(np.ndarray((n_embd, n), _UINT_OF_SIZE[el], state, at).T)
        v_descs.append((v_type, row))
        at += n * row

    if at != size:
        raise StateFormatError(f"state has {size - at} unexpected trailing bytes (a second cache section?)")
    layers = tuple(LayerFormat(kt, kr, vt, vr) for (kt, kr), (vt, vr) in zip(k_descs, v_descs))
    return _Parsed(CellFormat(layers, meta_bytes), n, bool(v_trans), seq_id, meta, tuple(keys), tuple(values), positions)


def _position_order(positions: np.ndarray, first: int = 0) -> np.ndarray | None:
    """Cell indices in position order, or None when the cells are already in order; positions must be exactly ``first..first+n-1``."""
    n = positions.size
    expected = np.arange(first, first + n, dtype=np.int32)
    if np.array_equal(positions, expected):
        return None
    order = np.argsort(positions, kind="stable")
    if not np.array_equal(positions[order], expected):
        raise StateFormatError(f"cell positions are not exactly {first}..{first + n - 1} (gaps, duplicates or an offset)")
    return order
