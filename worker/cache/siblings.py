"""A prefix another sequence of the same context holds, copied inside the context: no store, no evaluation.

With ``KVPOOL_PARALLEL`` = P, a job that lands on a sequence not holding its prefix
(because the sequence that does is busy, or the job came through the shared queue) would
otherwise restore the prefix from the store, a copy out of the context, through the
store, and back in, or evaluate it again. Instead, one task of the engine loop
(`worker.engine.loop`) copies the cells from the sibling that holds the most of the prompt:

1. it picks the sibling, in the loop's thread, between two rounds, where no sequence's
   cells can change under it: what a sequence holds exactly is the common prefix of the
   prompt and its view's tokens, up to ``Held.exact_upto`` and the view's ``n_tokens``
   (a decode replaces only cells from ``n_tokens`` on), under the same tenant;
2. it copies the sibling's stream into this sequence's (``llama_memory_seq_cp`` across
   streams, applied at once: `copy_stream`) and removes the cells past ``n``: the cells
   are the same bytes at the same places, and the answer the same bits, as the sibling's,
   a restore's and a cold evaluation's.

llama.cpp copies a whole stream across streams (one memcpy per layer, about 6 ms for
SmolLM2's 4,096 cells) but defers the copy to the next ``llama_decode``, and a task later
in the same iteration could change the source or read the destination first. So the copy
is applied inside the task, by ``llama_context::memory_update`` (what ``llama_decode``
calls first; an exported C++ method the C API of this llama.cpp does not wrap). A build
without it, or a copy that did not apply, goes through host memory instead: the
sibling's sequence state read, its stream moved to this sequence's place
(`worker.engine.sequence.restream`) and loaded, 50 to 800 ms for 1,500 to 4,000 tokens
(``docs/bench/siblings.md``).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp
import numpy as np

from worker import metrics
from worker.cache.held import Held
from worker.engine.llama_state import check_positions, read_ctx_state, write_ctx_state
from worker.engine.sequence import cell_positions, restream

log = logging.getLogger("kvpool.worker")

MIN_TOKENS = 32
"""Shorter prefixes are evaluated: a copy's fixed cost would not pay."""


def _memory_update() -> Callable[[Any, bool], bool] | None:
    """``bool llama_context::memory_update(bool optimize)`` of the loaded libllama, or None where it lacks the symbol.

    The mangled name fixes the parameters (a context, a bool); a build whose method has
    others does not have this symbol, and the copy goes through host memory.
    """
    fn = getattr(llama_cpp.llama_cpp._lib, "_ZN13llama_context13memory_updateEb", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_bool], ctypes.c_bool
    return fn


APPLY_UPDATES = _memory_update()
"""Applies a context's pending stream copies now; None: this build cannot (`copy_stream` then declines)."""


def held_for(held: Held, tenant: str, tokens: np.ndarray) -> int:
    """How many leading ``tokens`` ``held``'s sequence holds exactly for ``tenant``, by its records; read in the loop's thread."""
    view = held.llm
    if held.tenant != tenant:
        return 0
    n = min(held.exact_upto, view.n_tokens, len(tokens))
    mine = view.input_ids[:n]
    differ = (mine != tokens[:n]).nonzero()[0]
    return int(differ[0]) if len(differ) else n


def cells_cover(llm: llama_cpp.Llama, seq: int, n: int) -> bool:
    """Whether sequence ``seq``'s cells hold positions 0 ... n-1, as llama.cpp itself says; read in the loop's thread.

    A sequence's records (`held_for`) say what its job last made of it, and a record may lag
    its cells (a restore clearing them, a job that failed): copying from records alone
    once copied an emptied stream, and llama.cpp accepts positions from n with no cells
    below them, so the answer came out silently wrong. The cells are checked too.
    """
    lo, hi = cell_positions(llm.ctx, seq)
    return n > 0 and lo == 0 and hi >= n - 1


def copy_from_sibling(held: Held, siblings: Sequence[Held], tenant: str, tokens: list[int], upto: int, labels: dict[str, str]) -> int:
    """Load into ``held``'s sequence the longest prefix of ``tokens`` (at most ``upto``) a sibling holds; the cells now held.

    Returns 0, with nothing changed, when no sibling holds more than ``MIN_TOKENS`` of it
    beyond what this sequence holds already.
    """
    view = held.llm
    want = np.asarray(tokens[:upto], dtype=np.intc)
    have = held_for(held, tenant, want)
    others = [h for h in siblings if h is not held]
    if not others or upto - have < MIN_TOKENS:
        return 0
    t0 = time.perf_counter()

    def copy(llm: llama_cpp.Llama) -> tuple[int, int, str]:
        held_n = [(h, min(held_for(h, tenant, want), upto)) for h in others]
        src, n = max(((h, n) for h, n in held_n if cells_cover(llm, h.llm.seq, n)), key=lambda p: p[1], default=(None, 0))
        if src is None or n - have < MIN_TOKENS:
            if any(n - have >= MIN_TOKENS for _, n in held_n):
                log.warning("prefix.sibling_records_stale", extra={"to_seq": view.seq})  # records said more than the cells hold
            return -1, 0, ""
        seq = src.llm.seq
        view.reset()  # what this sequence held is gone from here on, whatever happens next
        held.hold(tenant, 0)
        how = "stream" if view.n_streams > 1 and copy_stream(llm, seq, view.seq) else "state"
        if how == "state":
            state = read_ctx_state(llm.ctx, seq)
            write_ctx_state(llm.ctx, state if view.n_streams == 1 else restream(state, seq, view.seq, view.n_streams), view.seq)
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), view.seq, n, -1)
        check_positions(llm.ctx, view.seq, n, f"a copy from sequence {seq}")
        view.input_ids[:n] = want[:n]
        view.n_tokens = n
        held.hold(tenant, n)  # set here, in the loop's thread: siblings' copies read it between rounds
        return seq, n, how

    seq, n, how = view.loop.run(view.seq, copy)
    if n == 0:
        return 0
    metrics.SIBLING_TOKENS.labels(**labels).inc(n)
    log.info(
        "prefix.sibling_copy", extra={"from_seq": seq, "to_seq": view.seq, "tokens": n, "how": how, "s": round(time.perf_counter() - t0, 4)}
    )
    return n


def copy_stream(llm: llama_cpp.Llama, src: int, dst: int) -> bool:
    """Copy sequence ``src``'s stream, every cell at its place, over sequence ``dst``'s, now; False (nothing changed) if it cannot.

    Runs in the loop's thread. ``dst``'s cells are replaced by ``src``'s whole stream;
    the caller removes those past the prefix it wants.
    """
    if APPLY_UPDATES is None or src == dst:
        return False
    mem = llama_cpp.llama_get_memory(llm.ctx)
    llama_cpp.llama_memory_seq_cp(mem, src, dst, -1, -1)
    if APPLY_UPDATES(llm.ctx, False):
        return True
    llama_cpp.llama_memory_seq_rm(mem, dst, -1, -1)  # the cells were claimed but their bytes not copied
    return False
