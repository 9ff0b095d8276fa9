"""Batch output: the append-only result file that makes a batch resumable, and the running tally."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from worker.protocol import JobResult

if TYPE_CHECKING:
    from gateway.batch.plan import Request
log = logging.getLogger("kvpool.batch")


class Results(Protocol):
    """Where the runner writes result lines: `ResultFile` for ``kvpool batch``, `gateway.batch.records.RedisResults` for the Batch API."""

    done: set[str]
    """The ids of the requests answered so far."""

    def write(self, record: dict[str, Any]) -> None: ...


class ResultFile:
    """The output file: read what an earlier run answered, then append one durable line per result."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: set[str] = set()
        self._f: BinaryIO | None = None

    def load(self) -> ResultFile:
        """Collect the ids already answered; a last line cut short by a kill is dropped (its request runs again)."""
        if not self.path.exists():
            return self
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning("output.partial_line_dropped", extra={"path": str(self.path), "bytes": len(data) - end})
            with open(self.path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        for n, raw in enumerate(data[:end].splitlines(), start=1):
            try:
                self.done.add(json.loads(raw)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                log.warning("output.unreadable_line", extra={"path": str(self.path), "line": n})
        return self

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "ab")  # held open for the whole run, closed by close()
        self._f.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done.add(record["id"])

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


@dataclass
class Tally:
    """What this run did, for the progress bar and the summary."""

    lines: int = 0
    already_done: int = 0
    answered: int = 0
    failed: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_from_context: int = 0
    cached_from_store: int = 0
    evaluated_tokens: int = 0
    completion_tokens: int = 0
    ideal_tokens: int = 0
    ideal_reused: int = 0
    started: float = field(default_factory=time.monotonic)

    def add(self, request: Request, result: JobResult) -> None:
        u = result.usage
        self.answered += 1
        self.prompt_tokens += u.prompt_tokens
        self.cached_tokens += u.cached_tokens
        self.cached_from_context += u.cached_from_context
        self.cached_from_store += u.cached_from_store
        self.evaluated_tokens += u.evaluated_tokens
        self.completion_tokens += u.completion_tokens
        self.ideal_tokens += request.ideal
        self.ideal_reused += min(u.cached_tokens, request.ideal)

    @property
    def hit_ratio(self) -> float:
        """Reused prompt tokens over all prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ideal_ratio(self) -> float:
        """The hit ratio whole-chunk sharing allows."""
        return self.ideal_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def of_ideal(self) -> float:
        """Reuse achieved over reuse allowed, each request counted up to its own ideal (token-level reuse
        from a worker's context can exceed whole chunks, and must not hide a missed chunk elsewhere)."""
        return self.ideal_reused / self.ideal_tokens if self.ideal_tokens else 1.0

    def finished(self) -> int:
        return self.already_done + self.answered + self.failed + self.rejected

    def summary(self) -> list[str]:
        elapsed = time.monotonic() - self.started
        done = self.answered + self.failed
        return [
            (
                f"requests: {self.lines} lines, {self.answered} answered, {self.failed} failed, {self.rejected} rejected, "
                f"{self.already_done} already done, in {elapsed:.1f} s ({done / elapsed if elapsed > 0 else 0.0:.1f} requests/s)"
            ),
            (
                f"tokens: {self.prompt_tokens:,} prompt = {self.evaluated_tokens:,} evaluated + {self.cached_tokens:,} reused "
                f"({self.cached_from_context:,} from a worker's context, {self.cached_from_store:,} from the store); "
                f"{self.completion_tokens:,} generated"
            ),
            f"hit ratio: {self.hit_ratio:.1%} of prompt tokens reused; whole-chunk sharing allows {self.ideal_ratio:.1%}",
            f"reuse: {self.ideal_reused:,} of {self.ideal_tokens:,} tokens that whole-chunk sharing allows "
            + (f"({self.of_ideal:.1%})" if self.ideal_tokens else "(no full chunk shared)"),
        ]
