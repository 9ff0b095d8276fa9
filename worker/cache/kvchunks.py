"""Cut one sequence's llama.cpp KV state into per-chunk payloads, and join payloads back.

kvpool stores a prompt's KV cache as content-addressed chunks of ``C`` tokens: chunk
``i`` holds the cells at positions ``i*C .. i*C+C-1``. This module converts between the
blob that llama.cpp produces and consumes for one sequence and those chunk payloads. It
is pure byte/numpy code; everything that talks to llama.cpp lives in
:mod:`worker.engine.llama_state`.

The blob is llama.cpp's sequence state (`worker.engine.kvstate` describes and parses it). Its
cells appear in cache-cell order, which after removals and reuse is not position order,
so cutting goes by each cell's ``pos``.

A payload is self-describing and independent of ``v_trans`` (flash attention on/off),
so one stored chunk serves contexts with either V layout::

    4s  magic = b"KVCL"           (KV cells; a blob, around it, starts b"KVPC")
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
decodes garbage), so :func:`join_state` insists on positions being exactly ``0..N-1``, and
:func:`cut_state` on exactly ``first..first+N-1``: ``first`` is 0 for a whole sequence's blob,
or where a window read began (``llama_kvpool_state_window``: only the cells of the chunks a
publisher lacks are copied), and the caller says which.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from worker.engine.kvstate import (
    _DATA_HEAD,
    _LAYER_DESC,
    _MAX_LAYERS,
    _PAYLOAD_HEAD,
    _ROW_HEAD,
    _STATE_HEAD,
    _UINT_OF_SIZE,
    _VT_HEAD,
    CELL_EXT_BYTES,
    CELL_META_BYTES,
    PAYLOAD_MAGIC,
    PAYLOAD_VERSION,
    STATE_MAGIC,
    Buffer,
    CellFormat,
    LayerFormat,
    StateFormatError,
    _parse_state,
    _Parsed,
    _position_order,
    _transposable_el_size,
)

_TRANSPOSE_BLOCK_BYTES = 1 << 17
"""Bytes of V rows transposed per block when joining: numpy's plain transposing copy thrashes the cache."""


@dataclass(frozen=True)
class PayloadInfo:
    layout: CellFormat
    n_cells: int
    first_pos: int


def describe_payload(payload: Buffer) -> PayloadInfo:
    layout, n_cells = _payload_head(payload)
    first_pos = struct.unpack_from("<i", payload, layout.header_bytes)[0] if n_cells else -1
    return PayloadInfo(layout, n_cells, first_pos)


def cut_state(state: Buffer, chunk_size: int, start_chunk: int = 0, stop_chunk: int | None = None, *, first: int = 0) -> list[bytes]:
    """One payload per full chunk ``start_chunk <= i < stop_chunk`` of a single-sequence blob.

    ``stop_chunk`` defaults to the number of full chunks; a partial last chunk is dropped.
    The blob's positions must be exactly ``first..first+N-1`` (in any cell order), and the
    chunks within them.
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    p = _parse_state(state)
    n_full = (first + p.n_cells) // chunk_size
    stop = n_full if stop_chunk is None else stop_chunk
    if not (first <= start_chunk * chunk_size and start_chunk <= stop <= n_full):
        raise ValueError(
            f"chunks [{start_chunk}, {stop}) are not within the full chunks of the state's positions {first}..{first + p.n_cells - 1}"
        )
    if start_chunk == stop:
        return []
    return _cut(p, start_chunk * chunk_size, stop - start_chunk, chunk_size, first)


def cut_cells(state: Buffer, start: int, stop: int, *, first: int = 0) -> bytes:
    """One payload holding the cells at positions ``start..stop-1`` (a prompt's tail, say) of a blob holding ``first..first+N-1``."""
    p = _parse_state(state)
    if not first <= start < stop <= first + p.n_cells:
        raise ValueError(f"cells [{start}, {stop}) are not within the state's positions {first}..{first + p.n_cells - 1}")
    return _cut(p, start, 1, stop - start, first)[0]


def head_cells(payload: Buffer, n: int) -> bytes:
    """A payload of the first ``n`` cells of ``payload`` (the part of a tail that a prompt shares)."""
    layout, n_cells = _payload_head(payload)
    if not 0 < n <= n_cells:
        raise ValueError(f"cannot take {n} of the {n_cells} cells of a payload")
    if n == n_cells:
        return bytes(payload)
    at = layout.header_bytes
    return layout._header(n) + bytes(memoryview(payload)[at : at + n * layout.bytes_per_token])


def _cut(p: _Parsed, lo: int, n_chunks: int, width: int, first: int) -> list[bytes]:
    """Payloads of ``n_chunks`` runs of ``width`` cells, from position ``lo`` on, of a blob whose positions begin at ``first``."""
    order = _position_order(p.positions, first)
    layout, a, b = p.layout, lo - first, lo - first + n_chunks * width
    rows: slice | np.ndarray = slice(a, b) if order is None else order[a:b]

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
    layout, parts, n_cells = _records(payloads)
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


def _records(payloads: Sequence[Buffer]) -> tuple[CellFormat, list[np.ndarray], int]:
    """Each payload's token records as a (tokens, bytes per token) view, checked to hold positions ``0..N-1`` of one sequence."""
    if not payloads:
        raise StateFormatError("nothing to join")
    layout: CellFormat | None = None
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
            raise StateFormatError(f"positions are not 0..N-1 in order: token {n_cells + bad} (payload {i}) has position {pos[bad]}")
        if not np.all(records[:, 4:8].view("<u4") == 1):
            raise StateFormatError(f"a cell of payload {i} does not belong to exactly one sequence")
        parts.append(records)
        n_cells += n
    assert layout is not None
    if n_cells == 0:
        raise StateFormatError("the payloads hold no cells")
    return layout, parts, n_cells


def _payload_head(payload: Buffer) -> tuple[CellFormat, int]:
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
    layers = tuple(LayerFormat(*_LAYER_DESC.unpack_from(payload, _PAYLOAD_HEAD.size + i * _LAYER_DESC.size)) for i in range(n_layer))
    layout = CellFormat(layers, meta_bytes)
    if len(payload) != layout.payload_bytes(n_cells):
        raise StateFormatError(f"payload is {len(payload)} bytes; {n_cells} cells of this layout need {layout.payload_bytes(n_cells)}")
    return layout, n_cells
