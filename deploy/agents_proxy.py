"""A recording proxy between a coding agent and a kvpool gateway (used by deploy/agents-check.sh; standard library only).

    python3 deploy/agents_proxy.py --port 18080 --upstream http://127.0.0.1:8000 --out DIR

Every request is forwarded as it came, its answer streamed back as it comes. Each request
body is kept as DIR/NNNN.json, and one line per request goes to DIR/requests.jsonl:
method, path, status, seconds to the first byte of the answer and to its end, and the
usage the answer reported (Anthropic's ``message_delta`` / whole message, the Responses
API's ``response.completed``, or a chat completion's ``usage``), so a run can be judged
afterwards: every status 200, and how much of each prompt came from cache.
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "accept-encoding"}


def usage_of(body: bytes) -> dict[str, Any] | None:
    """The last usage an answer (JSON or server-sent events) reports."""
    found: dict[str, Any] | None = None
    docs: list[Any] = []
    try:
        docs.append(json.loads(body))
    except (json.JSONDecodeError, UnicodeDecodeError):
        for line in body.decode("utf-8", "replace").splitlines():
            if line.startswith("data: ") and line[6:].strip() not in ("", "[DONE]"):
                try:
                    docs.append(json.loads(line[6:]))
                except json.JSONDecodeError:
                    continue
    for doc in docs:
        if not isinstance(doc, dict):
            continue
        for holder in (doc, doc.get("response"), doc.get("message")):
            if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                found = {**(found or {}), **holder["usage"]}
    return found


class Recorder:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.n = 0
        self.lock = threading.Lock()
        out.mkdir(parents=True, exist_ok=True)

    def next(self, body: bytes) -> int:
        with self.lock:
            self.n += 1
            n = self.n
        if body:
            (self.out / f"{n:04d}.json").write_bytes(body)
        return n

    def line(self, doc: dict[str, Any]) -> None:
        with self.lock, open(self.out / "requests.jsonl", "a") as f:
            f.write(json.dumps(doc) + "\n")


def handler(upstream: str, recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    target = urlsplit(upstream)

    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _forward(self) -> None:
            t0 = time.monotonic()
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            n = recorder.next(body)
            conn = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=3600)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            first = time.monotonic() - t0
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in HOP:
                    self.send_header(k, v)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            kept = bytearray()
            while chunk := resp.read1(65536):
                kept += chunk
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            conn.close()
            recorder.line(
                {
                    "n": n,
                    "method": self.command,
                    "path": self.path,
                    "status": resp.status,
                    "first_byte_s": round(first, 3),
                    "total_s": round(time.monotonic() - t0, 3),
                    "usage": usage_of(bytes(kept)),
                    "error": bytes(kept[:600]).decode("utf-8", "replace") if resp.status >= 400 else None,
                }
            )

        do_GET = do_POST = do_DELETE = do_HEAD = _forward

    return Proxy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", a.port), handler(a.upstream, Recorder(a.out)))
    server.serve_forever()


if __name__ == "__main__":
    main()
