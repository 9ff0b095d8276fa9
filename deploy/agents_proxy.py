"""A recording proxy between a coding agent and a kvpool gateway (used by deploy/agents-check.sh; standard library only).

    python3 deploy/agents_proxy.py serve --port 18080 --upstream http://127.0.0.1:8000 --out DIR
    python3 deploy/agents_proxy.py report --work WORK --out OUT --model NAME   # WORK/<agent>/requests.jsonl to OUT/report.md

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
            t0, at = time.monotonic(), time.time()
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            n = recorder.next(body)
            conn = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=3600)
            try:  # an agent that gives up closes the gateway's connection too: the gateway cancels the job
                self._relay(conn, body, n, t0, at)
            finally:
                conn.close()

        def _relay(self, conn: http.client.HTTPConnection, body: bytes, n: int, t0: float, at: float) -> None:
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
            recorder.line(
                {
                    "n": n,
                    "at": round(at, 3),
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


def cached_share(u: dict[str, Any]) -> tuple[int, int]:
    """(tokens read from cache, prompt tokens) of an answer's usage, Anthropic's or the Responses API's."""
    if "cache_read_input_tokens" in u:
        read = u.get("cache_read_input_tokens") or 0
        return read, read + (u.get("input_tokens") or 0) + (u.get("cache_creation_input_tokens") or 0)
    return (u.get("input_tokens_details") or {}).get("cached_tokens") or 0, u.get("input_tokens") or 0


def tools_in(folder: Path, n: int) -> int:
    """How many tools request ``n`` offered: the agent's own turns offer its tools; side requests (a session's title) none."""
    try:
        tools = json.loads((folder / f"{n:04d}.json").read_text()).get("tools")
    except (OSError, json.JSONDecodeError, AttributeError):
        return 0
    return len(tools) if isinstance(tools, list) else 0


def sessions(folder: Path, rows: list[dict[str, Any]]) -> list[str]:
    """How each session ended: its prompt, exit status, length, requests, and the last line it printed."""
    lines = []
    for n in (1, 2):
        try:
            start, end = (float((folder / f"session{n}.{k}").read_text()) for k in ("start", "end"))
            rc = int((folder / f"session{n}.rc").read_text())
        except (OSError, ValueError):
            continue
        prompt = (folder / f"session{n}.prompt").read_text().strip() if (folder / f"session{n}.prompt").exists() else ""
        printed = [x.strip() for x in (folder / f"session{n}.out").read_text(errors="replace").splitlines() if x.strip()]
        ended = "stopped by the timeout" if rc == 124 else f"exited with {rc}"
        asked = sum(1 for r in rows if r["method"] == "POST" and start <= r.get("at", 0) <= end)
        last = printed[-1][:200] if printed else ""
        lines.append(f"- session {n} ({prompt!r}): {ended} after {end - start:.0f} s, {asked} requests; it printed last: `{last}`")
    return lines


def report(work: Path, out: Path, model: str, versions: list[str]) -> bool:
    """OUT/report.md from each agent's WORK/<agent>/requests.jsonl; whether every agent passed.

    An agent passes when every request to the API (POST) was answered 200 and the second
    session's first answered turn (the first request that arrived after the time in
    ``session2.start`` and offers the agent's tools) read at least 85% of its prompt from
    cache.
    """
    out.mkdir(parents=True, exist_ok=True)
    lines, ok = [f"# kvpool with coding agents: {model}", "", *(f"- {v}" for v in versions), ""], True
    for agent in ("claude-code", "codex"):
        log = work / agent / "requests.jsonl"
        rows = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        api = [r for r in rows if r["method"] == "POST"]
        bad = [r for r in api if r["status"] != 200]
        marker = work / agent / "session2.start"
        start2 = float(marker.read_text().strip() or 0) if marker.exists() else 0.0
        second = next((r for r in api if r.get("at", r["n"]) > start2 and r["usage"] and tools_in(work / agent, r["n"])), None)
        read, prompt = cached_share(second["usage"]) if second else (0, 0)
        share = read / prompt if prompt else 0.0
        passed = bool(api) and not bad and share >= 0.85
        ok &= passed
        others = f"; others: {sorted({r['status'] for r in bad})}" if bad else ""
        answered = {r["n"] for r in rows}
        open_ = sorted(int(f.stem) for f in (work / agent).glob("[0-9][0-9][0-9][0-9].json") if int(f.stem) not in answered)
        others += f"; never finished (the agent gave up on them or the run stopped it): requests {open_}" if open_ else ""
        first_byte = f", first byte after {second['first_byte_s']} s" if second else ""
        lines += [
            f"## {agent}: {'PASS' if passed else 'FAIL'}",
            "",
            f"- requests to the API answered: {len(api)}, with 200: {len(api) - len(bad)}{others}",
            f"- second session's first turn: {read} of {prompt} prompt tokens read from cache ({share:.1%}){first_byte}",
            *sessions(work / agent, rows),
            "",
            *(f"  - {r['path']} {r['status']}: {(r['error'] or '')[:300]}" for r in bad[:10]),
            "| # | request | status | first byte s | total s | prompt tokens | from cache |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            c, p = cached_share(r["usage"]) if r["usage"] else (0, 0)
            lines.append(f"| {r['n']} | {r['method']} {r['path']} | {r['status']} | {r['first_byte_s']} | {r['total_s']} | {p} | {c} |")
        lines.append("")
        if log.exists():
            (out / f"{agent}-requests.jsonl").write_text(log.read_text())
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="record requests on their way to the gateway")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--upstream", required=True)
    serve.add_argument("--out", type=Path, required=True)
    rep = sub.add_parser("report", help="judge a run: OUT/report.md")
    rep.add_argument("--work", type=Path, required=True)
    rep.add_argument("--out", type=Path, required=True)
    rep.add_argument("--model", required=True)
    rep.add_argument("--versions", nargs="*", default=[])
    a = p.parse_args()
    if a.command == "report":
        raise SystemExit(0 if report(a.work, a.out, a.model, a.versions) else 1)
    ThreadingHTTPServer(("127.0.0.1", a.port), handler(a.upstream, Recorder(a.out))).serve_forever()


if __name__ == "__main__":
    main()
