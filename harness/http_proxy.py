"""A real HTTP proxy on loopback, in front of a storage server (moto, the GCS emulator), for tests.

It forwards every request unchanged over TCP and records what went through, so tests can prove what a client
fetched (`body_bytes_sent`, `log`) rather than trust the code that fetched it. It can also play a failing server:
    fail_next = n            answer the next n targeted requests with 503 (then forward again)
    fail_next = -1           answer every targeted request with 503
    targets(method, path)    which requests to fail or hold (default: writes, i.e. every PUT/POST)
    hold_targets = True      keep targeted requests waiting (`held` is set) until stop(): the server dies mid-upload
    stop()                   close the listener and every connection: the server is gone

Bounded: one thread per client connection, loopback only, bodies held in memory (tests move a few MB).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclass
class Exchange:
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int
    """Response body bytes the proxy sent to the client."""
    if_none_match: str | None = None
    """The request's If-None-Match header (S3's create-only-if-absent precondition)."""


class LoopbackProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname, parts.port)
        self.fail_next = 0
        self.targets: Callable[[str, str], bool] = lambda method, path: method in ("PUT", "POST")
        self.hold_targets = False
        self.held = threading.Event()
        self._stopped = threading.Event()
        self.injected_failures = 0
        self.log: list[Exchange] = []
        self._lock = threading.Lock()
        self._connections: set = set()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def setup(self) -> None:
                super().setup()
                with proxy._lock:
                    proxy._connections.add(self.connection)

            def finish(self) -> None:
                with proxy._lock:
                    proxy._connections.discard(self.connection)
                super().finish()

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self) -> None:
                body = self._body()
                targeted = proxy.targets(self.command, self.path)
                if targeted and proxy.hold_targets:
                    proxy.held.set()
                    proxy._stopped.wait(60)
                    return  # the server died with the request in hand: nothing reaches storage
                if targeted and proxy._should_fail():
                    payload = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>ServiceUnavailable</Code>"
                               b"<Message>injected by the test proxy</Message></Error>")
                    # recorded before answering: once the client has the answer, the log has the exchange
                    proxy._record(Exchange(self.command, self.path, None, 503, len(payload)))
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in _HOP_BY_HOP and k.lower() not in ("expect", "content-length")}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection(*proxy._upstream, timeout=30)
                try:
                    upstream.request(self.command, self.path, body=body or None, headers=headers)
                    response = upstream.getresponse()
                    payload = response.read()
                    self.send_response(response.status, response.reason)
                    for k, v in response.getheaders():
                        if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                            self.send_header(k, v)
                    # a HEAD answer has no body but states the object's size
                    length = response.getheader("Content-Length", "0") if self.command == "HEAD" else len(payload)
                    self.send_header("Content-Length", str(length))
                    proxy._record(Exchange(self.command, self.path, self.headers.get("Range"), response.status,
                                           0 if self.command == "HEAD" else len(payload),
                                           self.headers.get("If-None-Match")))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="test-proxy", daemon=True)

    def _should_fail(self) -> bool:
        with self._lock:
            if self.fail_next == 0:
                return False
            if self.fail_next > 0:
                self.fail_next -= 1
            self.injected_failures += 1
            return True

    def _record(self, exchange: Exchange) -> None:
        with self._lock:
            self.log.append(exchange)

    def reset_log(self) -> None:
        with self._lock:
            self.log.clear()

    @property
    def body_bytes_sent(self) -> int:
        with self._lock:
            return sum(e.body_bytes for e in self.log)

    def start(self) -> LoopbackProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection, as a crashed server would."""
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    def __enter__(self) -> LoopbackProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
