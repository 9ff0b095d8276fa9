"""Cut one sequence's llama.cpp KV state into per-chunk payloads, and join payloads back.

kvpool stores a prompt's KV cache as content-addressed chunks of ``C`` tokens: chunk
``i`` holds the cells at positions ``i*C .. i*C+C-1``. This module converts between the
blob that llama.cpp produces and consumes for one sequence and those chunk payloads. It
is pure byte/numpy code; everything that talks to llama.cpp lives in
:mod:`worker.llama_state`.

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
cells appear in cache-cell order, which after removals and reuse is not position order,
so cutting goes by each cell's ``pos``.

A payload is self-describing and independent of ``v_trans`` (flash attention on/off),
so one stored chunk serves contexts with either V layout::

    4s  magic = b"KVPC"
    u16 version = 1
    u16 cell_meta_bytes              12, or 24 with ext
    u32 n_cells
    u32 n_layer
    n_layer x (i32 k_type, u32 k_row_bytes, i32 v_type, u32 v_row_bytes)
    n_cells x token record           cell metadata (verbatim), then per layer K row, V row

The records are in position order, so the size is ``header + n_cells * bytes_per_token``
with ``bytes_per_token = cell_meta_bytes + sum(k_row + v_row)``. Joining payloads for
chunks ``0..k-1`` yields the blob llama.cpp would have written for that prefix had its
cells been in position order.

llama.cpp does not validate what it loads (a blob without chunk 0 is accepted and
decodes garbage), so :func:`cut_state` and :func:`join_state` insist on positions being
exactly ``0..N-1``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

Buffer: TypeAlias = bytes | bytearray | memoryview

STATE_MAGIC = 0xAF143CD8
PAYLOAD_MAGIC = b"KVPC"
PAYLOAD_VERSION = 1

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
_TRANSPOSE_BLOCK_BYTES = 1 << 17

_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class StateFormatError(ValueError):
    """A state blob or payload is not in the layout this module understands."""


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
class LayerLayout:
    k_type: int
    k_row_bytes: int
    v_type: int
    v_row_bytes: int


@dataclass(frozen=True)
class StateLayout:
    """What one token of a sequence's KV state looks like, independent of the V layout."""

    layers: tuple[LayerLayout, ...]
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
    ) -> StateLayout:
        """The layout of a model whose layers all share one K and one V width."""
        layer = LayerLayout(
            type_k, ggml_row_bytes(type_k, n_embd_k_gqa), type_v, ggml_row_bytes(type_v, n_embd_v_gqa)
        )
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
        return head + b"".join(
            _LAYER_DESC.pack(lay.k_type, lay.k_row_bytes, lay.v_type, lay.v_row_bytes) for lay in self.layers
        )

    def _field_offsets(self) -> list[tuple[int, int]]:
        """Offsets of each layer's K and V row inside a token record."""
        offsets, at = [], self.cell_meta_bytes
        for lay in self.layers:
            offsets.append((at, at + lay.k_row_bytes))
            at += lay.k_row_bytes + lay.v_row_bytes
        return offsets


def kv_bytes_per_token(
    n_layer: int,
    n_embd_k_gqa: int,
    n_embd_v_gqa: int,
    type_k: int = GGML_TYPE_F16,
    type_v: int = GGML_TYPE_F16,
    cell_meta_bytes: int = CELL_META_BYTES,
) -> int:
    """Stored bytes per token: cell metadata plus every layer's K and V row."""
    return StateLayout.uniform(n_layer, n_embd_k_gqa, n_embd_v_gqa, type_k, type_v, cell_meta_bytes).bytes_per_token


@dataclass(frozen=True)
class StateInfo:
    """What :func:`describe_state` found in a blob."""

    layout: StateLayout
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
class PayloadInfo:
    layout: StateLayout
    n_cells: int
    first_pos: int


@dataclass(frozen=True)
class _Parsed:
    """Byte offsets of every section of a blob; the arrays are views into it."""

    layout: StateLayout
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
    contiguous = in_order or (
        pos_max - pos_min + 1 == p.n_cells and bool(np.array_equal(np.sort(pos), np.arange(pos_min, pos_max + 1)))
    )
    return StateInfo(p.layout, p.n_cells, p.v_trans, p.seq_id, pos_min, pos_max, in_order, contiguous)


def describe_payload(payload: Buffer) -> PayloadInfo:
    layout, n_cells = _payload_head(payload)
    first_pos = struct.unpack_from("<i", payload, layout.header_bytes)[0] if n_cells else -1
    return PayloadInfo(layout, n_cells, first_pos)


def cut_state(state: Buffer, chunk_size: int, start_chunk: int = 0, stop_chunk: int | None = None) -> list[bytes]:
    """One payload per full chunk ``start_chunk <= i < stop_chunk`` of a single-sequence blob.

    ``stop_chunk`` defaults to the number of full chunks; a partial last chunk is dropped.
    The blob's positions must be exactly ``0..N-1`` (in any cell order).
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    p = _parse_state(state)
    n_full = p.n_cells // chunk_size
    stop = n_full if stop_chunk is None else stop_chunk
    if not 0 <= start_chunk <= stop <= n_full:
        raise ValueError(f"chunks [{start_chunk}, {stop}) are not within the {n_full} full chunks of the state")
    if start_chunk == stop:
        return []
    return _cut(p, start_chunk * chunk_size, stop - start_chunk, chunk_size)


def cut_cells(state: Buffer, start: int, stop: int) -> bytes:
    """One payload holding the cells at positions ``start..stop-1`` (a prompt's tail, say)."""
    p = _parse_state(state)
    if not 0 <= start < stop <= p.n_cells:
        raise ValueError(f"cells [{start}, {stop}) are not within the {p.n_cells} cells of the state")
    return _cut(p, start, 1, stop - start)[0]


def head_cells(payload: Buffer, n: int) -> bytes:
    """A payload of the first ``n`` cells of ``payload`` (the part of a tail that a prompt shares)."""
    layout, n_cells = _payload_head(payload)
    if not 0 < n <= n_cells:
        raise ValueError(f"cannot take {n} of the {n_cells} cells of a payload")
    if n == n_cells:
        return bytes(payload)
    at = layout.header_bytes
    return layout._header(n) + bytes(memoryview(payload)[at : at + n * layout.bytes_per_token])


def _cut(p: _Parsed, lo: int, n_chunks: int, width: int) -> list[bytes]:
    """Payloads of ``n_chunks`` runs of ``width`` cells, from position ``lo`` on."""
    order = _position_order(p.positions)
    layout, hi = p.layout, lo + n_chunks * width
    rows: slice | np.ndarray = slice(lo, hi) if order is None else order[lo:hi]

    header = np.frombuffer(layout._header(width), np.uint8)
    h, bpt = header.size, layout.bytes_per_token
    out = np.empty((n_chunks, h + width * bpt), np.uint8)
    out[:, :h] = header

    def dest(start: int, nbytes: int, dtype: type = np.uint8) -> np.ndarray:
        """Field ``[start, start+nbytes)`` bytes of every token record, as (chunk, token, nbytes)."""
        item = np.dtype(dtype).itemsize
        return np.ndarray((n_chunks, width, nbytes // item), dtype, out, h + start, (out.strides[0], bpt, item))

    def gather(src: np.ndarray) -> np.ndarray:
        return src[rows].reshape(n_chunks, width, -1)

    dest(0, layout.cell_meta_bytes)[...] = gather(p.meta)
    for lay, (k_at, v_at), keys, values in zip(layout.layers, layout._field_offsets(), p.keys, p.values):
        dest(k_at, lay.k_row_bytes)[...] = gather(keys)
        dest(v_at, lay.v_row_bytes, values.dtype.type)[...] = gather(values)
    return [row.tobytes() for row in out]


def join_state(payloads: Sequence[Buffer], *, v_trans: bool) -> bytearray:
    """The blob for chunks ``0..k-1`` given their payloads in order.

    ``v_trans`` is the V layout of the context that will load it: True when flash
    attention is off. The payloads must share one layout and, together, hold positions
    exactly ``0..N-1`` in order.

    This is on the path to a restored request's first token, so each payload's rows are
    copied once, straight into the blob (tens of MB for a long prompt of a 1B model).
    """
    if not payloads:
        raise StateFormatError("nothing to join")
    layout: StateLayout | None = None
    parts: list[np.ndarray] = []
    n_cells = 0
    for i, payload in enumerate(payloads):
        lay, n = _payload_head(payload)
        if layout is None:
            layout = lay
        elif lay != layout:
            raise StateFormatError(f"payload {i} has a different layout from payload 0")
        records = np.frombuffer(payload, np.uint8, n * lay.bytes_per_token, lay.header_bytes).reshape(n, lay.bytes_per_token)
        pos = records[:, 0:4].view("<i4").ravel()
        expected = np.arange(n_cells, n_cells + n, dtype=np.int32)
        if not np.array_equal(pos, expected):
            bad = int(np.argmax(pos != expected))
            raise StateFormatError(
                f"positions are not 0..N-1 in order: token {n_cells + bad} (payload {i}) has position {pos[bad]}"
            )
        if not np.all(records[:, 4:8].view("<u4") == 1):
            raise StateFormatError(f"a cell of payload {i} does not belong to exactly one sequence")
        parts.append(records)
        n_cells += n
    assert layout is not None
    if n_cells == 0:
        raise StateFormatError("the payloads hold no cells")
    bpt, meta_bytes = layout.bytes_per_token, layout.cell_meta_bytes
    seq_id = int(parts[0][0, meta_bytes - 4 : meta_bytes].view("<i4")[0])

    out = bytearray(layout.state_bytes(n_cells))
    buf = np.frombuffer(out, np.uint8)

    def rows(at: int, lo: int, width: int) -> int:
        """Copy bytes ``[lo, lo+width)`` of every token record into the section at ``at``; returns its end."""
        for part in parts:
            buf[at : at + len(part) * width].reshape(len(part), width)[...] = part[:, lo : lo + width]
            at += len(part) * width
        return at

    _STATE_HEAD.pack_into(out, 0, STATE_MAGIC, seq_id, 1, n_cells)
    at = rows(_STATE_HEAD.size, 0, meta_bytes)
    _DATA_HEAD.pack_into(out, at, int(v_trans), layout.n_layer)
    at += _DATA_HEAD.size

    offsets = layout._field_offsets()
    for lay, (k_at, _) in zip(layout.layers, offsets):
        _ROW_HEAD.pack_into(out, at, lay.k_type, lay.k_row_bytes)
        at = rows(at + _ROW_HEAD.size, k_at, lay.k_row_bytes)
    for lay, (_, v_at) in zip(layout.layers, offsets):
        if not v_trans:
            _ROW_HEAD.pack_into(out, at, lay.v_type, lay.v_row_bytes)
            at = rows(at + _ROW_HEAD.size, v_at, lay.v_row_bytes)
            continue
        el = _transposable_el_size(lay.v_type)
        n_embd = lay.v_row_bytes // el
        _VT_HEAD.pack_into(out, at, lay.v_type, el, n_embd)
        at += _VT_HEAD.size
        dim_major = np.ndarray((n_embd, n_cells), _UINT_OF_SIZE[el], out, at)
        # numpy's plain transposing copy thrashes the cache; blocks of tokens run ~2x faster.
        block = max(16, _TRANSPOSE_BLOCK_BYTES // lay.v_row_bytes)
        t0 = 0
        for part in parts:
            token_major = np.ndarray((len(part), n_embd), _UINT_OF_SIZE[el], part, v_at, (bpt, el))
            for t in range(0, len(part), block):
                rows_t = token_major[t : t + block]
                dim_major[:, t0 + t : t0 + t + len(rows_t)] = rows_t.T
            t0 += len(part)
        at += n_cells * lay.v_row_bytes
    assert at == len(out)
    return out


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
        return _Parsed(StateLayout(()), 0, False, seq_id, empty, (), (), empty)
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
    layers = tuple(LayerLayout(kt, kr, vt, vr) for (kt, kr), (vt, vr) in zip(k_descs, v_descs))
    return _Parsed(
        StateLayout(layers, meta_bytes), n, bool(v_trans), seq_id, meta, tuple(keys), tuple(values), positions
    )


def _position_order(positions: np.ndarray) -> np.ndarray | None:
    """Cell indices in position order, or None when the cells are already in order."""
    n = positions.size
    expected = np.arange(n, dtype=np.int32)
    if np.array_equal(positions, expected):
        return None
    order = np.argsort(positions, kind="stable")
    if not np.array_equal(positions[order], expected):
        raise StateFormatError(f"cell positions are not exactly 0..{n - 1} (gaps, duplicates or an offset)")
    return order


def _payload_head(payload: Buffer) -> tuple[StateLayout, int]:
    if len(payload) < _PAYLOAD_HEAD.size:
        raise StateFormatError("payload is truncated")
    magic, version, meta_bytes, n_cells, n_layer = _PAYLOAD_HEAD.unpack_from(payload, 0)
    if magic != PAYLOAD_MAGIC:
        raise StateFormatError(f"bad payload magic {magic!r}")
    if version != PAYLOAD_VERSION:
        raise StateFormatError(f"unsupported payload version {version}")
    if meta_bytes not in (CELL_META_BYTES, CELL_META_BYTES + CELL_EXT_BYTES) or not 0 < n_layer <= _MAX_LAYERS:
        raise StateFormatError(f"implausible payload header (cell_meta_bytes={meta_bytes}, n_layer={n_layer})")
    if len(payload) < _PAYLOAD_HEAD.size + n_layer * _LAYER_DESC.size:
        raise StateFormatError("payload is truncated")
    layers = tuple(
        LayerLayout(*_LAYER_DESC.unpack_from(payload, _PAYLOAD_HEAD.size + i * _LAYER_DESC.size))
        for i in range(n_layer)
    )
    layout = StateLayout(layers, meta_bytes)
    if len(payload) != layout.payload_bytes(n_cells):
        raise StateFormatError(
            f"payload is {len(payload)} bytes; {n_cells} cells of this layout need {layout.payload_bytes(n_cells)}"
        )
    return layout, n_cells
