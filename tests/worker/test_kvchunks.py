"""Specification of cutting a sequence's KV state blob into chunk payloads and joining them back.

Synthetic blobs are written by ``_blob`` below, a literal transcription of llama.cpp's
``llama_kv_cache::state_write`` (one stream, one sequence); the last tests check the
same properties on real blobs from the generated tiny model.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import THREADS
from worker.cache.kvchunks import cut_cells, cut_state, describe_payload, join_state
from worker.engine.kvstate import (
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    GGML_TYPE_Q8_0,
    PAYLOAD_MAGIC,
    CellFormat,
    LayerFormat,
    StateFormatError,
    describe_state,
    state_cell_count,
)
from worker.engine.llama_state import read_seq_state

F16_LAYERS = (
    LayerFormat(GGML_TYPE_F16, 16, GGML_TYPE_F16, 24),
    LayerFormat(GGML_TYPE_F16, 32, GGML_TYPE_F16, 8),
    LayerFormat(GGML_TYPE_F16, 16, GGML_TYPE_F16, 16),
)
F32_LAYERS = (LayerFormat(GGML_TYPE_F32, 32, GGML_TYPE_F32, 16),) * 2


class Cells:
    """Per-cell contents in cell order: metadata fields and token-major K/V rows per layer."""

    def __init__(self, positions: list[int], layers: tuple[LayerFormat, ...], ext: bool, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        n = len(positions)
        self.positions = positions
        self.layers = layers
        self.ext = [rng.integers(0, 2**31, 3).tolist() for _ in range(n)] if ext else None
        self.k = [rng.integers(0, 256, (n, lay.k_row_bytes), dtype=np.uint8) for lay in layers]
        self.v = [rng.integers(0, 256, (n, lay.v_row_bytes), dtype=np.uint8) for lay in layers]

    def select(self, cells: list[int] | np.ndarray) -> Cells:
        out = Cells.__new__(Cells)
        out.positions = [self.positions[i] for i in cells]
        out.layers = self.layers
        out.ext = None if self.ext is None else [self.ext[i] for i in cells]
        out.k = [k[cells] for k in self.k]
        out.v = [v[cells] for v in self.v]
        return out

    def in_position_order(self, n: int | None = None) -> Cells:
        return self.select(np.argsort(self.positions, kind="stable")[:n])


def _blob(cells: Cells, *, v_trans: bool, seq_id: int = 0, n_seq_id: int = 1) -> bytes:
    out = [struct.pack("<IiII", 0xAF143CD8, seq_id, 1, len(cells.positions))]
    for i, pos in enumerate(cells.positions):
        out.append(struct.pack("<iI", pos, n_seq_id))
        if cells.ext is not None:
            out.append(struct.pack("<iii", *cells.ext[i]))
        out.append(struct.pack("<i", seq_id) * n_seq_id)
    out.append(struct.pack("<II", int(v_trans), len(cells.layers)))
    for lay, k in zip(cells.layers, cells.k):
        out.append(struct.pack("<iQ", lay.k_type, lay.k_row_bytes) + k.tobytes())
    for lay, v in zip(cells.layers, cells.v):
        if not v_trans:
            out.append(struct.pack("<iQ", lay.v_type, lay.v_row_bytes) + v.tobytes())
        else:
            el = {GGML_TYPE_F16: 2, GGML_TYPE_F32: 4}.get(lay.v_type, 34)
            dt = {2: np.uint16, 4: np.uint32}.get(el, np.uint8)
            out.append(struct.pack("<iII", lay.v_type, el, lay.v_row_bytes // el))
            out.append(np.ascontiguousarray(v.view(dt).T).tobytes())
    return b"".join(out)


def _shuffled(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).permutation(n).tolist()


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("ext", [False, True])
@pytest.mark.parametrize("layers", [F16_LAYERS, F32_LAYERS], ids=["f16", "f32"])
def test_join_of_cut_is_the_blob_of_the_prefix(v_trans: bool, ext: bool, layers: tuple[LayerFormat, ...]) -> None:
    cells = Cells(list(range(50)), layers, ext)
    blob = _blob(cells, v_trans=v_trans, seq_id=3)
    for chunk in (1, 10, 16, 50):
        k = 50 // chunk
        prefix = _blob(cells.in_position_order(k * chunk), v_trans=v_trans, seq_id=3)
        assert join_state(cut_state(blob, chunk), v_trans=v_trans) == prefix


@pytest.mark.parametrize("v_trans", [False, True])
def test_cut_goes_by_position_not_by_cell(v_trans: bool) -> None:
    cells = Cells(_shuffled(64), F16_LAYERS, ext=False)
    blob = _blob(cells, v_trans=v_trans)
    info = describe_state(blob)
    assert (info.in_order, info.contiguous, info.pos_min, info.pos_max) == (False, True, 0, 63)
    payloads = cut_state(blob, 16)
    assert [describe_payload(p).first_pos for p in payloads] == [0, 16, 32, 48]
    assert join_state(payloads[:3], v_trans=v_trans) == _blob(cells.in_position_order(48), v_trans=v_trans)


def test_payloads_do_not_depend_on_the_v_layout() -> None:
    cells = Cells(_shuffled(40), F16_LAYERS, ext=True)
    transposed, plain = _blob(cells, v_trans=True), _blob(cells, v_trans=False)
    payloads = cut_state(transposed, 8)
    assert payloads == cut_state(plain, 8)
    assert join_state(payloads, v_trans=False) == _blob(cells.in_position_order(), v_trans=False)
    assert join_state(payloads, v_trans=True) == _blob(cells.in_position_order(), v_trans=True)


@pytest.mark.parametrize("ext", [False, True])
def test_payload_size_is_a_constant_header_plus_bytes_per_token(ext: bool) -> None:
    cells = Cells(list(range(64)), F16_LAYERS, ext)
    blob = _blob(cells, v_trans=True)
    layout = describe_state(blob).layout
    meta = 24 if ext else 12
    assert layout.bytes_per_token == meta + sum(lay.k_row_bytes + lay.v_row_bytes for lay in F16_LAYERS)
    headers = set()
    for chunk in (1, 4, 16, 64):
        for payload in cut_state(blob, chunk):
            assert len(payload) == layout.payload_bytes(chunk)
            headers.add(len(payload) - chunk * layout.bytes_per_token)
    assert headers == {16 + 16 * len(F16_LAYERS)} == {layout.header_bytes}
    assert len(blob) == layout.state_bytes(64)


@pytest.mark.parametrize("v_trans", [False, True])
def test_a_window_of_positions_cuts_into_the_same_chunks_and_tail_as_the_whole_blob(v_trans: bool) -> None:
    cells = Cells(_shuffled(70), F16_LAYERS, ext=False)
    whole = _blob(cells, v_trans=v_trans)
    window = _blob(cells.select([i for i, pos in enumerate(cells.positions) if pos >= 32]), v_trans=v_trans)
    assert cut_state(window, 16, 2, first=32) == cut_state(whole, 16, 2) == cut_state(whole, 16)[2:]
    assert cut_cells(window, 64, 70, first=32) == cut_cells(whole, 64, 70)
    with pytest.raises(ValueError):
        cut_state(window, 16, 1, first=32)  # chunk 1 is not in the window
    with pytest.raises(ValueError):
        cut_cells(window, 30, 40, first=32)
    with pytest.raises(StateFormatError):
        cut_state(window, 16, 2, first=16)  # the blob's positions are not where the caller says they begin
    with pytest.raises(StateFormatError):
        cut_state(window, 16, 0, 1)  # read as a whole sequence's blob


def test_a_range_of_chunks() -> None:
    blob = _blob(Cells(_shuffled(70), F32_LAYERS, ext=False), v_trans=True)
    every = cut_state(blob, 16)
    assert len(every) == 4
    assert cut_state(blob, 16, 1, 3) == every[1:3]
    assert cut_state(blob, 16, start_chunk=3) == every[3:]
    assert cut_state(blob, 16, 2, 2) == []
    for start, stop in [(0, 5), (3, 2), (-1, 2)]:
        with pytest.raises(ValueError):
            cut_state(blob, 16, start, stop)
    with pytest.raises(ValueError):
        cut_state(blob, 0)


def test_describe() -> None:
    cells = Cells(list(range(20)), F16_LAYERS, ext=True)
    info = describe_state(_blob(cells, v_trans=True, seq_id=5))
    assert info.layout == CellFormat(F16_LAYERS, cell_meta_bytes=24)
    assert (info.n_cells, info.v_trans, info.seq_id, info.in_order) == (20, True, 5, True)
    payload = cut_state(_blob(cells, v_trans=False), 5)[2]
    assert describe_payload(payload).layout == info.layout
    assert (describe_payload(payload).n_cells, describe_payload(payload).first_pos) == (5, 10)
    assert payload[:4] == PAYLOAD_MAGIC


def test_an_empty_state() -> None:
    empty = struct.pack("<IiII", 0xAF143CD8, 0, 1, 0)
    assert state_cell_count(empty) == 0
    assert cut_state(empty, 16) == []
    with pytest.raises(StateFormatError):
        describe_state(empty)
    with pytest.raises(StateFormatError):
        join_state([], v_trans=False)


def test_bytes_per_token() -> None:
    # TinyLlama 1.1B: 22 layers, 4 KV heads x 64.
    assert CellFormat.uniform(22, 256, 256).bytes_per_token == 12 + 22 * (512 + 512) == 22540
    assert CellFormat.uniform(22, 256, 256, GGML_TYPE_Q8_0, GGML_TYPE_Q8_0).bytes_per_token == 12 + 22 * 2 * (256 // 32 * 34)
    with pytest.raises(ValueError):
        CellFormat.uniform(1, 100, 128, GGML_TYPE_Q8_0, GGML_TYPE_F16)


@settings(max_examples=60, deadline=None, database=None)
@given(
    n=st.integers(1, 80),
    chunk=st.integers(1, 40),
    v_trans=st.booleans(),
    ext=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(n: int, chunk: int, v_trans: bool, ext: bool, seed: int) -> None:
    cells = Cells(np.random.default_rng(seed).permutation(n).tolist(), F16_LAYERS, ext, seed)
    payloads = cut_state(_blob(cells, v_trans=not v_trans), chunk)
    assert len(payloads) == n // chunk
    if payloads:
        expected = _blob(cells.in_position_order(n // chunk * chunk), v_trans=v_trans)
        assert join_state(payloads, v_trans=v_trans) == expected


# --- what is refused ---------------------------------------------------------------------


def _good() -> bytes:
    return _blob(Cells(list(range(32)), F16_LAYERS, ext=False), v_trans=True)


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda b: b"\0\0\0\0" + b[4:], id="bad-magic"),
        pytest.param(lambda b: b[:8] + struct.pack("<I", 2) + b[12:], id="two-streams"),
        pytest.param(lambda b: b + b"\0", id="trailing-byte"),
        pytest.param(lambda b: b + b, id="second-section"),
        pytest.param(lambda b: b[:-1], id="truncated-end"),
        pytest.param(lambda b: b[:200], id="truncated-middle"),
        pytest.param(lambda b: b[:14], id="truncated-header"),
        pytest.param(lambda b: b[: 16 + 32 * 12] + struct.pack("<I", 7) + b[16 + 32 * 12 + 4 :], id="bad-v_trans"),
    ],
)
def test_malformed_states_are_refused(mutate) -> None:
    with pytest.raises(StateFormatError):
        cut_state(mutate(_good()), 16)


def test_every_truncation_is_refused() -> None:
    good = _good()
    for size in range(0, len(good), 37):
        with pytest.raises(StateFormatError):
            describe_state(good[:size])


def test_cells_shared_by_sequences_are_refused() -> None:
    blob = _blob(Cells(list(range(16)), F16_LAYERS, ext=False), v_trans=False, n_seq_id=2)
    with pytest.raises(StateFormatError, match="sequence"):
        cut_state(blob, 16)


@pytest.mark.parametrize(
    "positions",
    [
        pytest.param([0, 1, 2, 4], id="gap"),
        pytest.param([0, 1, 1, 2], id="duplicate"),
        pytest.param([1, 2, 3, 4], id="offset"),
        pytest.param([3, 0, 3, 1], id="shuffled-duplicate"),
    ],
)
def test_positions_must_be_exactly_0_to_n(positions: list[int]) -> None:
    blob = _blob(Cells(positions, F16_LAYERS, ext=False), v_trans=True)
    assert not describe_state(blob).contiguous or describe_state(blob).pos_min != 0
    with pytest.raises(StateFormatError, match="position"):
        cut_state(blob, 2)


def test_quantized_v_cannot_be_transposed() -> None:
    q8 = (LayerFormat(GGML_TYPE_Q8_0, 34, GGML_TYPE_Q8_0, 34),)
    payloads = cut_state(_blob(Cells(list(range(8)), q8, ext=False), v_trans=False), 4)
    assert join_state(payloads, v_trans=False)
    with pytest.raises(StateFormatError, match="flash attention"):
        join_state(payloads, v_trans=True)


def test_join_needs_contiguous_positions_from_zero() -> None:
    payloads = cut_state(_good(), 8)
    assert join_state(payloads, v_trans=True) == _good()
    for bad in ([payloads[1], payloads[2]], [payloads[0], payloads[2]], [payloads[1], payloads[0]], payloads[:1] * 2):
        with pytest.raises(StateFormatError, match="position"):
            join_state(bad, v_trans=True)


def test_join_refuses_mixed_or_damaged_payloads() -> None:
    a = cut_state(_good(), 8)
    other = cut_state(_blob(Cells(list(range(32)), F32_LAYERS, ext=False), v_trans=True), 8)
    version = bytearray(a[1])
    version[4] = 9
    for bad in (
        [a[0], other[1]],
        [a[0], a[1][:-1]],
        [a[0], a[1] + b"\0"],
        [a[0], b"XXXX" + a[1][4:]],
        [a[0], bytes(version)],
        [a[0][:10]],
    ):
        with pytest.raises(StateFormatError):
            join_state(bad, v_trans=True)


# --- real blobs from llama.cpp ----------------------------------------------------------

TOKENS = [1] + np.random.default_rng(7).integers(3, 2048, 199).tolist()


@pytest.fixture(scope="module")
def native_blobs(tiny_model: Path) -> dict[tuple[str, bool], dict[int, bytes]]:
    """Native blobs of several prefix lengths, per (cache type, flash attention)."""
    from worker.engine.context import open_llama

    blobs: dict[tuple[str, bool], dict[int, bytes]] = {}
    for cache, fa in [("f16", False), ("f16", True), ("q8_0", True)]:
        llm = open_llama(tiny_model, flash_attn=fa, type_k=cache, n_threads=THREADS, n_threads_batch=THREADS)
        blobs[cache, fa] = {}
        for n in (64, 96, 200):
            llm.reset()
            llm.eval(TOKENS[:n])
            blobs[cache, fa][n] = read_seq_state(llm)
        llm.close()
    return blobs


@pytest.mark.parametrize(("cache", "fa"), [("f16", False), ("f16", True), ("q8_0", True)])
@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_joined_chunks_equal_the_native_blob_of_the_prefix(
    native_blobs: dict[tuple[str, bool], dict[int, bytes]], cache: str, fa: bool, chunk: int
) -> None:
    blobs = native_blobs[cache, fa]
    for n in (64, 96):
        if n % chunk:
            continue
        joined = join_state(cut_state(blobs[200], chunk, 0, n // chunk), v_trans=not fa)
        assert joined == blobs[n]


def test_native_payloads_serve_either_v_layout(native_blobs: dict[tuple[str, bool], dict[int, bytes]]) -> None:
    off, on = native_blobs["f16", False], native_blobs["f16", True]
    assert describe_state(off[64]).v_trans and not describe_state(on[64]).v_trans
    from_off = cut_state(off[200], 32, 0, 2)
    assert join_state(from_off, v_trans=True) == off[64]
    assert len(join_state(from_off, v_trans=False)) == len(on[64])


@pytest.mark.parametrize(("cache", "fa", "row"), [("f16", False, 2 * 64 * 2), ("f16", True, 2 * 64 * 2), ("q8_0", True, 2 * 34 * 2)])
def test_sizes_follow_from_the_model_dimensions(
    native_blobs: dict[tuple[str, bool], dict[int, bytes]], cache: str, fa: bool, row: int
) -> None:
    # tiny: 4 layers, 2 KV heads of 64: an f16 row is n_head_kv * head_dim * 2 bytes, q8_0 packs 32 values in 34.
    n_layer = 4
    layout = describe_state(native_blobs[cache, fa][200]).layout
    assert layout.n_layer == n_layer
    assert all((lay.k_row_bytes, lay.v_row_bytes) == (row, row) for lay in layout.layers)
    assert layout.bytes_per_token == 12 + n_layer * (row + row)
    header = layout.header_bytes
    for chunk in (16, 32, 64):
        payloads = cut_state(native_blobs[cache, fa][200], chunk)
        assert len(payloads) == 200 // chunk
        assert {len(p) for p in payloads} == {layout.bytes_per_token * chunk + header}
    assert len(native_blobs[cache, fa][200]) == layout.state_bytes(200)
