"""Real loopback HTTP servers for the image-fetch tests (tests/extractor/test_media.py, tests/serve/test_images.py):
http.server in a thread on 127.0.0.1, answering each path by a script of answers, recording every request.

    LoopbackServer({path: [answer, ...]}, tls=None)   the k-th request of a path gets its k-th answer (the last one
                                              repeats); tls=(certfile, keyfile): https
        .url(path) / .hits (paths, in order) / .connections (TCP connections accepted) / .close()
                                              also a context manager
    image(bytes) / status(code) / redirect(location, code) / drip(bytes, every_s) / hang_up() /
    encoded(bytes, encoding)                 the answers
    png_bytes(width, height, mode)           a small PNG drawn here
    self_signed_cert(folder) -> (certfile, keyfile)   a certificate for 127.0.0.1 and localhost signed by its own key
                                              (the `cryptography` package, else the openssl command; the test is
                                              skipped without either)
    ListeningSocket()                         a bare TCP listener that answers nothing; .connections() counts those
                                              made to it (a URL of another scheme must open none)
"""

from __future__ import annotations

import http.server
import io
import os
import shutil
import socket
import ssl
import subprocess
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Answer:
    kind: str
    body: bytes = b""
    code: int = 200
    location: str = ""
    every_s: float = 0.0
    encoding: str = ""


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


def encoded(body: bytes, encoding: str = "gzip") -> Answer:
    """`body` as it is on the wire (the caller compressed it), sent with Content-Encoding: `encoding`."""
    return Answer("image", body, encoding=encoding)


def png_bytes(width: int = 16, height: int = 12, mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (width, height), 1 if mode == "1" else "red").save(buf, format="PNG")
    return buf.getvalue()


def self_signed_cert(folder: str) -> tuple[str, str]:
    """(certfile, keyfile) in `folder`: a certificate for 127.0.0.1 and localhost, signed by its own key."""
    import pytest

    cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    try:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("a self-signed certificate needs the cryptography package or the openssl command")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                        "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
        return cert, key
    import ipaddress

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                               x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .sign(private, hashes.SHA256()))
    with open(cert, "wb") as f:
        f.write(certificate.public_bytes(serialization.Encoding.PEM))
    with open(key, "wb") as f:
        f.write(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    return cert, key


class LoopbackServer:
    def __init__(self, routes: dict[str, list[Answer]], tls: tuple[str, str] | None = None) -> None:
        self.routes = routes
        self.hits: list[str] = []
        self.connections = 0
        self.closing = threading.Event()
        self._lock = threading.Lock()
        self.scheme = "https" if tls else "http"
        outer = self
        context = None
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer._answer(self)

            def log_message(self, *args) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def get_request(self):
                conn, addr = super().get_request()
                with outer._lock:
                    outer.connections += 1
                if context is None:
                    return conn, addr
                conn.settimeout(5)  # the handshake runs on the accepting thread: never waits for long
                try:  # a client that refuses the certificate ends it here
                    wrapped = context.wrap_socket(conn, server_side=True)
                except OSError:
                    conn.close()
                    raise
                wrapped.settimeout(None)
                return wrapped, addr

            def handle_error(self, request, client_address) -> None:
                pass  # a client that went away, or refused the certificate

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

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
        if a.encoding:
            h.send_header("Content-Encoding", a.encoding)
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
