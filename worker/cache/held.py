"""What one sequence's context holds that a job may keep: its tenant, how many leading cells are exact, their keys.

A `Held` per sequence (`worker.answering`); `worker.cache.prefix` asks it how much of a prompt the
context holds, `worker.cache.siblings` how much a sibling sequence holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from store.chain import PrefixKey, extend_chain, prefix_namespace
from store.tails import common_prefix
from worker.engine.kvcache import ContextCache
from worker.engine.llama_state import Llama, seq_positions
from worker.engine.sequence import SeqView


@dataclass
class Held:
    """What one sequence's context holds that a job may keep."""

    llm: SeqView
    kv: ContextCache
    tenant: str | None = None
    """The tenant whose prompts filled the context: a hit across tenants would leak prompts through timing."""
    exact_upto: int = 0
    """Leading cells that hold exactly what a cold evaluation of their tokens would (never one-token decodes)."""
    _known: tuple[str | None, np.ndarray, list[PrefixKey]] = (None, np.zeros(0, dtype=np.int32), [])
    """Prefix keys of tokens the context held (`learn`), extended rather than hashed again."""

    def hold(self, tenant: str, n: int) -> None:
        self.tenant, self.exact_upto = tenant, n

    def forget(self) -> None:
        """Start the next job from an empty context (after a failure its contents are unknown)."""
        self.tenant, self.exact_upto = None, 0
        self.llm.reset()

    def learn(self, tenant: str, tokens: Sequence[int], keys: list[PrefixKey]) -> None:
        """The prefix keys of ``tokens`` (a job's, checked against its tokens): `prefix_keys` starts from them."""
        self._known = (tenant, np.asarray(tokens, dtype=np.int32), keys)

    def prefix_keys(self, fingerprint: str, chunk_size: int) -> list[PrefixKey]:
        """Prefix keys of the full chunks held exactly: only the chunks past what `learn` was told are hashed."""
        if self.tenant is None or self.exact_upto == 0:
            return []
        held = np.asarray(self.llm.input_ids[: min(self.exact_upto, self.llm.n_tokens)], dtype=np.int32)
        tenant, tokens, keys = self._known
        same = min(common_prefix(tokens, held), len(keys) * chunk_size) // chunk_size if tenant == self.tenant else 0
        root = prefix_namespace(fingerprint, chunk_size, self.tenant).key
        out: list[PrefixKey] = extend_chain(root, keys[:same], held, chunk_size)  # type: ignore[assignment]
        self._known = (self.tenant, held.copy(), out)
        return out

    def local_prefix(self, tenant: str, tokens: list[int]) -> int:
        """How many leading prompt tokens the context holds exactly for ``tenant``; another tenant's context is dropped."""
        if self.tenant != tenant or not self.kv.prefix_reuse or self.exact_upto == 0:
            self.forget()
            return 0
        n = common_prefix(self.llm.input_ids[: min(self.exact_upto, self.llm.n_tokens)], tokens)
        return n if window_held(self.llm, self.kv, n) else 0


def window_held(llm: Llama, kv: ContextCache, n: int) -> bool:
    """Whether the context can be cut back to ``n`` cells: a sliding-window cache must still hold the window before ``n``.

    It keeps only the cells a next token may attend to, so after a checkpoint's restore, or
    once old cells were reused, an earlier position's window is gone (llama-server makes
    the same test before it reuses a slot).
    """
    if kv.n_swa == 0 or n == 0:
        return True
    return seq_positions(llm)[0] <= max(0, n - kv.n_swa)
