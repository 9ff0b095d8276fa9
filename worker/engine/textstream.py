"""Turning generated token ids into text as they come: whole UTF-8 characters only, stop strings held back."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol


class Detokenizer(Protocol):
    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes: ...


class TextStream:
    """Feeds token ids in, gets out text that is safe to show now.

    Text that could be the start of a stop string is held back until it is clearly not
    one; when a stop string appears, the text ends just before it (as in OpenAI's API).
    """

    def __init__(self, detok: Detokenizer, stop: Sequence[str] = ()) -> None:
        self.detok = detok
        self.stop = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._tokens: list[int] = []
        self._pending = ""
        self.text = ""
        self.stopped = False
        self.matched: str | None = None
        """The stop string that ended the text."""

    def push(self, token: int) -> str:
        """Add one token; return the text that became safe to emit (possibly empty)."""
        piece = self.detok.detokenize([token], prev_tokens=self._tokens or None)
        self._tokens.append(token)
        self._pending += self._decoder.decode(piece)
        for s in self.stop:
            at = self._pending.find(s)
            if at >= 0:
                self.stopped, self.matched = True, s
                return self._release(self._pending[:at])
        hold = max((k for s in self.stop for k in range(1, len(s)) if self._pending.endswith(s[:k])), default=0)
        return self._release(self._pending[: len(self._pending) - hold])

    def flush(self) -> str:
        """The generation ended without a stop string: release everything held back."""
        self._pending += self._decoder.decode(b"", final=True)
        return self._release(self._pending)

    def _release(self, out: str) -> str:
        self._pending = self._pending[len(out) :] if not self.stopped else ""
        self.text += out
        return out
