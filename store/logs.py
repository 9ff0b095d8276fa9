"""Structured logging: one line per event, ``event key=value ...`` (or JSON), fields passed as ``extra``.

Usage: ``log.info("chunk.corrupt", extra={"key": k.hex(), "reason": str(e)})``.
Never put prompt text in a field logged at INFO or above.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class EventFormatter(logging.Formatter):
    def __init__(self, as_json: bool = False) -> None:
        super().__init__()
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields = {k: v for k, v in record.__dict__.items() if k not in _RESERVED}
        if record.exc_info and record.exc_info[1] is not None:
            fields["error"], fields["where"] = describe_exception(record.exc_info[1])
        if self.as_json:
            doc = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name}
            return json.dumps({**doc, "event": record.getMessage(), **fields}, default=str)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [ts, record.levelname.lower(), record.name, record.getMessage()]
        parts += [f"{k}={_value(v)}" for k, v in fields.items()]
        return " ".join(parts)


def describe_exception(e: BaseException) -> tuple[str, str]:
    """``Type: message`` of an exception (of each one inside an exception group), and where the first was raised."""
    leaves: list[BaseException] = []

    def walk(x: BaseException) -> None:
        if isinstance(x, BaseExceptionGroup):
            for inner in x.exceptions:
                walk(inner)
        else:
            leaves.append(x)

    walk(e)
    tb = leaves[0].__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""
    return "; ".join(f"{type(x).__name__}: {x}" for x in leaves), where


def _value(v: object) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' "=\n')) else s


CHATTY = ("httpx", "httpcore")
"""Libraries that log every request they make at INFO: heard from at WARNING, unless the level is DEBUG."""


def configure_logging(level: str = "INFO", as_json: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EventFormatter(as_json))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.NOTSET if root.level <= logging.DEBUG else logging.WARNING)
