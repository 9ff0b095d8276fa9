"""Faults of a real Redis that a test cannot get by stopping the server: a reply lost after the write ran."""

from __future__ import annotations

import socket
import threading

from gateway.pool.procs import free_port


class ReplyLosingProxy:
    """A TCP proxy in front of a real Redis that can drop the connection after Redis ran a write but before its reply reaches the client.

    That is what a client sees of a Redis shut down (SIGTERM) between running a write and
    writing its reply: the write is applied, and persisted, and the client gets a
    connection error.
    """

    def __init__(self, redis_port: int) -> None:
        self.redis_port = redis_port
        self.port = free_port()
        self.armed = threading.Event()
        self.only_with = b""
        """Lose the reply only of a write whose commands contain these bytes (a command's name)."""
        self.pipelines = False
        """Lose the reply of a pipeline (sent in one piece, answered in one piece), not only a transaction's."""
        self.lost = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.redis_port))
            swallow = threading.Event()
            threading.Thread(target=self._requests, args=(client, upstream, swallow), daemon=True).start()
            threading.Thread(target=self._replies, args=(upstream, client, swallow), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, swallow: threading.Event) -> None:
        while data := _recv(client):
            if self.armed.is_set() and (self.pipelines or b"EXEC\r\n" in data) and self.only_with in data:
                self.armed.clear()
                swallow.set()
            upstream.sendall(data)
        upstream.close()

    def _replies(self, upstream: socket.socket, client: socket.socket, swallow: threading.Event) -> None:
        seen = b""
        while data := _recv(upstream):
            if not swallow.is_set():
                client.sendall(data)
                continue
            seen += data
            if self.pipelines or b"QUEUED\r\n*" in seen:  # a pipeline's replies (Redis runs what one read brought, then replies), or EXEC's
                _hang_up(client)
                _hang_up(upstream)
                self.lost.set()
                return
        client.close()

    def __enter__(self) -> ReplyLosingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _hang_up(sock: socket.socket) -> None:
    """Close now: a plain close waits for the other thread's pending ``recv`` before the peer sees it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
