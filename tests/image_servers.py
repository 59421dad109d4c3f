"""Real loopback HTTP servers for the image-fetch tests (tests/extractor/test_media.py, tests/serve/test_images.py):
http.server in a thread on 127.0.0.1, answering each path by a script of answers, recording every request.

    LoopbackServer({path: [answer, ...]})   the k-th request of a path gets its k-th answer (the last one repeats)
        .url(path) / .hits (paths, in order) / .close()    also a context manager
    image(bytes) / status(code) / redirect(location, code) / drip(bytes, every_s) / hang_up()     the answers
    png_bytes(width, height, mode)           a small PNG drawn here
    ListeningSocket()                         a bare TCP listener that answers nothing; .connections() counts those
                                              made to it (a URL of another scheme must open none)
"""

from __future__ import annotations

import http.server
import io
import socket
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Answer:
    kind: str
    body: bytes = b""
    code: int = 200
    location: str = ""
    every_s: float = 0.0


def image(body: bytes) -> Answer:
    return Answer("image", body)


def status(code: int) -> Answer:
    return Answer("status", b"no", code)


def redirect(location: str, code: int = 302) -> Answer:
    return Answer("redirect", code=code, location=location)


def drip(body: bytes, every_s: float) -> Answer:
    """The whole answer, status line and headers included, one byte every `every_s` seconds."""
    return Answer("drip", body, every_s=every_s)


def hang_up() -> Answer:
    """Close the connection without answering."""
    return Answer("hang_up")


def png_bytes(width: int = 16, height: int = 12, mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (width, height), 1 if mode == "1" else "red").save(buf, format="PNG")
    return buf.getvalue()


class LoopbackServer:
    def __init__(self, routes: dict[str, list[Answer]]) -> None:
        self.routes = routes
        self.hits: list[str] = []
        self.closing = threading.Event()
        self._lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer._answer(self)

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def _answer(self, h: http.server.BaseHTTPRequestHandler) -> None:
        path = h.path.split("?")[0]
        with self._lock:
            k = sum(p == path for p in self.hits)
            self.hits.append(path)
        script = self.routes.get(path) or [status(404)]
        a = script[min(k, len(script) - 1)]
        if a.kind == "hang_up":
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if a.kind == "drip":
            raw = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: %d\r\n\r\n" % len(a.body) + a.body
            h.close_connection = True
            try:
                for i in range(len(raw)):
                    h.wfile.write(raw[i:i + 1])
                    h.wfile.flush()
                    if self.closing.wait(a.every_s):
                        return
            except OSError:  # the client went away
                pass
            return
        h.send_response(a.code)
        if a.kind == "redirect":
            h.send_header("Location", a.location)
        h.send_header("Content-Type", "image/png" if a.kind == "image" else "text/plain")
        h.send_header("Content-Length", str(len(a.body)))
        h.end_headers()
        h.wfile.write(a.body)

    def close(self) -> None:
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> LoopbackServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ListeningSocket:
    """A TCP listener on 127.0.0.1 that never accepts: a connection made to it waits in the kernel's backlog, where
    `connections()` counts it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sock.setblocking(False)

    def connections(self) -> int:
        """How many connections were made so far (accepted now, and closed)."""
        count = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return count
            conn.close()
            count += 1

    def close(self) -> None:
        self.sock.close()
