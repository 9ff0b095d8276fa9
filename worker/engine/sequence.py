"""One sequence of a shared multi-sequence context, seen by one job as if it were a context of its own.

`SeqView` offers the part of ``llama_cpp.Llama`` that the engine uses (``eval``,
``n_tokens``, ``input_ids``, sampling, the tokenizer) for sequence ``seq`` of a context
opened with ``n_seq_max`` streams; every decode and every other call
into the context is work handed to the `worker.engine.loop.EngineLoop` that owns it, and the
view waits for the result: a job's thread never touches the context. A generation
(`generate`) runs on the loop's thread from its first step to its last, which updates
the view's records as it decodes. `worker.engine.llama_state`
reads and restores a view's state through `read_state` and `write_state`, which convert
llama.cpp's multi-stream sequence state to the single-stream blob every other worker
writes (and back): a chunk is the same bytes whatever ``KVPOOL_PARALLEL`` its publisher
ran with.

The multi-stream blob of sequence s (``llama_kv_cache::state_write``) is the
single-stream one with ``n_stream`` = P and an empty ``u32 0`` cell count for each
other stream, written in stream order (stream s holds sequence s); on load, llama.cpp
puts the one non-empty stream into the sequence's own stream whatever its place.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import llama_cpp
import numpy as np

from worker.engine.kvstate import as_sequence_zero
from worker.engine.loop import EngineLoop, Watch, token_data
from worker.engine.rounds import Request
from worker.errors import StateReadError

_HEAD = struct.Struct("<IiI")  # magic, seq_id, n_stream
_EMPTY = struct.pack("<I", 0)


class SeqView:
    """Sequence ``seq`` of the context ``loop`` owns, with ``n_ctx`` cells of its own."""

    def __init__(self, loop: EngineLoop, seq: int, n_streams: int, n_ctx: int) -> None:
        self.loop = loop
        self.seq = seq
        self.n_streams = n_streams
        self._llm = loop.llm
        self.watch: Watch | None = None
        """Asked between prompt pieces whether the job should stop (`worker.engine.loop`); set by the engine for a job."""
        self._n_ctx = n_ctx
        self.n_tokens = 0
        self.input_ids = np.zeros(n_ctx, dtype=np.intc)
        self.logits = np.zeros(loop.n_vocab, dtype=np.float32)
        self._sampler: Any = None
        self._seed = self._llm._seed
        self._requires_eval = True
        self._cand, self._cand_view = token_data(loop.n_vocab)
        self._ids = np.arange(loop.n_vocab, dtype=np.intc)

    # -- what the engine reads of a Llama --------------------------------------------

    @property
    def model(self) -> Any:
        return self._llm.model

    @property
    def _model(self) -> Any:
        return self._llm._model

    @property
    def metadata(self) -> dict[str, str]:
        return self._llm.metadata

    @property
    def context_params(self) -> Any:
        return self._llm.context_params

    @property
    def n_batch(self) -> int:
        return self._llm.n_batch

    @property
    def _n_vocab(self) -> int:
        return self.loop.n_vocab

    @property
    def last_n_tokens_size(self) -> int:
        return self._llm.last_n_tokens_size

    @property
    def _input_ids(self) -> np.ndarray:
        return self.input_ids[: self.n_tokens]

    def n_vocab(self) -> int:
        return self.loop.n_vocab

    def n_ctx(self) -> int:
        return self._n_ctx

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._llm.tokenize(text, add_bos, special)

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        return self._llm.detokenize(tokens, prev_tokens, special)

    def set_seed(self, seed: int) -> None:
        self._seed = seed

    def close(self) -> None:
        """The context belongs to the engine that opened it."""

    # -- decoding --------------------------------------------------------------------

    def reset(self) -> None:
        self.n_tokens = 0
        self._requires_eval = True

    def eval(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` after the first ``n_tokens`` cells (the cells past them are removed first)."""
        tokens = list(tokens)
        self._check_room(tokens, self.n_tokens)
        self.loop.decode(self.seq, tokens, self.n_tokens, watch=self.watch, record=self._record)

    def generate(self, tokens: list[int], pos: int, next_step: Callable[[], tuple[list[int], int] | None]) -> None:
        """Decode the step ``tokens`` at ``pos``, then each step ``next_step`` names, until it names none.

        ``next_step`` runs on the loop's thread after each step, once this view's records
        hold the step (its tokens, its logits): it samples from them and returns the next
        step's tokens and position (`worker.engine.decoding.step_tokens`). The records change with
        the cells: a step's position is recorded as the end of what is held before it is
        decoded (the cells from there on are replaced), its tokens once it is. The view's
        watch is not asked: a client's cancel comes back with the token sent after it, and
        the choice ends ``cancelled`` with what it made (`worker.engine.sampling.Choice`).
        """

        def advance(req: Request) -> tuple[list[int], int] | None:
            self._took(req.tokens, req.pos, req.out)
            step = next_step()
            if step is not None:
                self._check_room(step[0], step[1])
                self.n_tokens = step[1]
            return step

        self._check_room(tokens, pos)
        self.n_tokens = pos
        self.loop.generate(self.seq, tokens, pos, advance)  # a cancel is seen by the stream's next token (the choice ends cancelled)

    def _check_room(self, tokens: Sequence[int], pos: int) -> None:
        if pos + len(tokens) > self._n_ctx:
            raise RuntimeError(f"{pos + len(tokens)} tokens do not fit the sequence's {self._n_ctx} cells")

    def _record(self, req: Request) -> None:
        """`_took` for a decoded prompt piece (`EngineLoop.decode`'s ``record``), on the loop's thread."""
        assert req.out is not None
        self._took(req.tokens, req.pos, req.out[-1].copy() if req.rows else req.out)

    def _took(self, tokens: Sequence[int], pos: int, logits: Any) -> None:
        """The records of ``tokens`` decoded at ``pos``: what the cells hold up to their end, and the last token's logits; on the loop's thread."""
        self.logits = logits
        self.input_ids[pos : pos + len(tokens)] = tokens
        self.n_tokens = pos + len(tokens)
        self._requires_eval = False

    def decode_rows(self, tokens: Sequence[int]) -> np.ndarray:
        """Like `eval`, returning the logits of every token (for scoring a prompt)."""
        return self.loop.decode(self.seq, list(tokens), self.n_tokens, rows=True, watch=self.watch, record=self._record)

    @contextlib.contextmanager
    def watching(self, watch: Watch | None) -> Iterator[None]:
        """While a job runs: its decodes ask ``watch`` between prompt pieces whether to stop (`worker.engine.loop`)."""
        self.watch = watch
        try:
            yield
        finally:
            self.watch = None

    def positions(self) -> tuple[int, int]:
        """The first and last position of this sequence's cells (-1, -1 when none)."""
        return self.loop.run(self.seq, lambda llm: cell_positions(llm.ctx, self.seq))

    def clear(self) -> None:
        """Remove every cell of the sequence, and what the view records of them, in one task of the loop.

        The records change with the cells, on the loop's thread: a sibling's copy in the same
        batch of tasks (`worker.cache.siblings`) never finds records of cells that are gone.
        """

        def clear(llm: llama_cpp.Llama) -> None:
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), self.seq, -1, -1)
            self.reset()

        self.loop.run(self.seq, clear)

    # -- sampling (llama-cpp-python's chain, applied to this sequence's logits) --------

    def _init_sampler(self, **kwargs: Any) -> Any:
        return llama_cpp.Llama._init_sampler(self, **kwargs)  # type: ignore[arg-type]

    def sample(self, idx: int | None = None) -> int:
        """What ``llama_sampler_sample`` does with the context's logits, done with this sequence's copy."""
        assert self._sampler is not None and idx is None
        view = self._cand_view
        view["id"] = self._ids  # the chain sorts the array in place: put every id back
        view["logit"] = self.logits
        view["p"] = 0.0
        arr = llama_cpp.llama_token_data_array(
            data=ctypes.cast(self._cand, ctypes.POINTER(llama_cpp.llama_token_data)), size=len(view), selected=-1, sorted=False
        )
        llama_cpp.llama_sampler_apply(self._sampler.sampler, ctypes.byref(arr))
        if arr.selected < 0:
            raise RuntimeError("the sampler chain selected no token")
        token = int(arr.data[arr.selected].id)
        llama_cpp.llama_sampler_accept(self._sampler.sampler, token)
        return token

    # -- state, in the single-stream format ------------------------------------------

    def read_state(self, read: Any, into: Any = None) -> Any:
        """``read(ctx, seq, into)`` on the loop, as the single-stream blob (a view of the buffer read into, not a copy)."""
        blob = self.loop.run(self.seq, lambda llm: read(llm.ctx, self.seq, into))
        return blob if self.n_streams == 1 else single_stream(blob, self.seq, self.n_streams)

    def write_state(
        self,
        write: Any,
        state: bytes | bytearray | memoryview,
        tokens: Sequence[int],
        check: Callable[[Any, int, int], None] | None = None,
    ) -> None:
        """``write(ctx, blob, seq)`` on the loop, with the single-stream ``state`` converted for this context, then, in the
        same task, ``check(ctx, seq, len(tokens))`` if given and the records of ``tokens``: they change with the cells."""
        blob = state if self.n_streams == 1 else multi_stream(state, self.seq, self.n_streams)

        def load(llm: llama_cpp.Llama) -> None:
            write(llm.ctx, blob, self.seq)
            if check is not None:
                check(llm.ctx, self.seq, len(tokens))
            self.input_ids[: len(tokens)] = tokens
            self.n_tokens = len(tokens)

        self.loop.run(self.seq, load)


def cell_positions(ctx: Any, seq: int) -> tuple[int, int]:
    """The first and last position sequence ``seq``'s cells hold in ``ctx`` (-1, -1 when none), as llama.cpp says; on the loop's thread."""
    mem = llama_cpp.llama_get_memory(ctx)
    return int(llama_cpp.llama_memory_seq_pos_min(mem, seq)), int(llama_cpp.llama_memory_seq_pos_max(mem, seq))


def single_stream(blob: bytearray | memoryview, seq: int, n_streams: int) -> memoryview:
    """A multi-stream sequence state as the single-stream blob of sequence 0, in place: a view of ``blob``, rewritten.

    The single-stream header takes the 12 bytes just before the stream's data (the old
    header's end and the empty counts of the streams before it), and the empty counts after
    it are left out of the view, so a 48 MB state costs no copy (two copies and an
    allocation took about 40 ms, holding the GIL, on every snapshot of a shared context).
    """
    magic, seq_id, n = _HEAD.unpack_from(blob, 0)
    if n != n_streams:
        raise StateReadError(f"state has {n} streams, the context {n_streams}")
    head, before = _HEAD.size, 4 * seq
    after = 4 * (n_streams - 1 - seq)
    if blob[head : head + before] != _EMPTY * seq or (after and blob[len(blob) - after :] != _EMPTY * (n_streams - 1 - seq)):
        raise StateReadError(f"sequence {seq}'s state holds cells of another stream")
    out = memoryview(blob)[before : len(blob) - after]
    _HEAD.pack_into(out, 0, magic, seq_id, 1)
    as_sequence_zero(out)
    return out


def multi_stream(state: bytes | bytearray | memoryview, seq: int, n_streams: int) -> bytearray:
    """A single-stream blob as this context's sequence state: its one stream, then the others' empty counts."""
    magic, seq_id, n = _HEAD.unpack_from(state, 0)
    if n != 1:
        raise ValueError(f"expected a single-stream state, got {n} streams")
    return bytearray(_HEAD.pack(magic, seq_id, n_streams)) + bytes(state[_HEAD.size :]) + _EMPTY * (n_streams - 1)


def restream(blob: bytes | bytearray, src: int, dst: int, n_streams: int) -> bytearray:
    """Sequence ``src``'s multi-stream state as sequence ``dst``'s: its one stream moved to ``dst``'s place (one copy).

    The cells' sequence ids stay ``src``'s: llama.cpp discards them when it loads a sequence.
    """
    magic, seq_id, n = _HEAD.unpack_from(blob, 0)
    if n != n_streams:
        raise StateReadError(f"state has {n} streams, the context {n_streams}")
    head, size = _HEAD.size, len(blob) - _HEAD.size - 4 * (n_streams - 1)
    out = bytearray(len(blob))  # zeros: every other stream's empty cell count
    _HEAD.pack_into(out, 0, magic, dst, n_streams)
    out[head + 4 * dst : head + 4 * dst + size] = memoryview(blob)[head + 4 * src : head + 4 * src + size]
    return out
