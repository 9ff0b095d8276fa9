"""Batch input lines: reading, parsing and checking them, with their line numbers."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.errors import APIError

log = logging.getLogger("kvpool.batch")

URLS = {"/v1/completions": False, "/v1/chat/completions": True}
"""The endpoints a batch line may name, and whether each is chat."""


@dataclass(frozen=True)
class Line:
    """One non-blank input line, as read."""

    number: int
    raw: str


@dataclass(frozen=True)
class Parsed:
    """A line with the fields a batch request needs; its body is not checked yet."""

    line: Line
    custom_id: str
    chat: bool
    body: dict[str, Any]


@dataclass(frozen=True)
class Rejected:
    """A line that can never become a job: answered with an error result and reported by its line number.

    With ``api_error`` the result carries an HTTP-style response whose body is the one the
    API answers the same body with, word for word (its custom_id says which line it was);
    without, an ``error`` object with ``code`` and a ``message`` naming the line.
    """

    line: int
    result_id: str
    custom_id: str | None
    code: str
    message: str
    api_error: APIError | None = None

    def report(self) -> str:
        return f"line {self.line}: {self.message}"

    def record(self) -> dict[str, Any]:
        if self.api_error is not None:
            response = {"status_code": self.api_error.status, "request_id": None, "body": self.api_error.body()}
            return result_record(self.result_id, self.custom_id, response=response)
        return result_record(self.result_id, self.custom_id, error={"code": self.code, "message": self.report()})


def read_lines(path: Path) -> list[Line]:
    """The non-blank lines of the input, numbered from 1 as an editor shows them."""
    with open(path, "rb") as f:
        return [Line(n, raw.decode("utf-8", "replace").strip()) for n, raw in enumerate(f, start=1) if raw.strip()]


def request_result_id(custom_id: str) -> str:
    """Derived from the custom_id, so a rerun recognises the request's result in the output."""
    return "batch_req_" + hashlib.sha256(b"custom_id\0" + custom_id.encode()).hexdigest()[:32]


def line_result_id(line: Line) -> str:
    """For lines without a usable custom_id: derived from the line's number and text."""
    return "batch_req_" + hashlib.sha256(f"line\0{line.number}\0{line.raw}".encode()).hexdigest()[:32]


def parse_line(line: Line) -> Parsed | Rejected:
    """Check a line's structure (JSON object, custom_id, method, url, body object); the body's contents come later."""

    def bad(code: str, message: str, custom_id: str | None = None) -> Rejected:
        return Rejected(line.number, line_result_id(line), custom_id, code, message)

    try:
        doc = json.loads(line.raw)
    except json.JSONDecodeError as e:
        return bad("invalid_json", f"invalid JSON: {e.msg} (column {e.colno})")
    if not isinstance(doc, dict):
        return bad("invalid_json", f"expected a JSON object, got {type(doc).__name__}")
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return bad("missing_custom_id", "custom_id is missing or not a non-empty string")
    missing = [k for k in ("method", "url", "body") if k not in doc]
    if missing:
        return bad("missing_field", f"missing field(s): {', '.join(missing)}", custom_id)
    if not isinstance(doc["method"], str) or doc["method"].upper() != "POST":
        return bad("invalid_method", f"method must be POST, got {doc['method']!r}", custom_id)
    if doc["url"] not in URLS:
        return bad("invalid_url", f"url must be one of {', '.join(URLS)}, got {doc['url']!r}", custom_id)
    if not isinstance(doc["body"], dict):
        return bad("invalid_body", "body must be a JSON object", custom_id)
    return Parsed(line, custom_id, URLS[doc["url"]], doc["body"])


def parse_all(lines: Iterable[Line]) -> list[Parsed | Rejected]:
    """Parse every line; a custom_id seen on an earlier line makes a later one a duplicate.

    A duplicate's error result has no custom_id, so that whoever maps results by custom_id
    finds the answer to the first line, not the complaint about the second.
    """
    seen: dict[str, int] = {}
    out: list[Parsed | Rejected] = []
    for line in lines:
        p = parse_line(line)
        if isinstance(p, Parsed):
            first = seen.setdefault(p.custom_id, line.number)
            if first != line.number:
                p = Rejected(
                    line.number,
                    line_result_id(line),
                    None,
                    "duplicate_custom_id",
                    f"duplicate custom_id {p.custom_id!r} (first on line {first})",
                )
        out.append(p)
    return out


def result_id_of(entry: Parsed | Rejected) -> str:
    return request_result_id(entry.custom_id) if isinstance(entry, Parsed) else entry.result_id


def result_record(
    result_id: str, custom_id: str | None, *, response: dict[str, Any] | None = None, error: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"id": result_id, "custom_id": custom_id, "response": response, "error": error}
