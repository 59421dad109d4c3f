"""Reading an HTTP answer from a peer hsx does not control (a server of `hsx regenerate`, an image URL): its bytes
bounded, and no redirect followed unless the caller checked where it goes.

    read_bounded(response, cap, decode=False) -> bytes | None
                                                    an aiohttp response's body, or None once it passes cap
                                                    (decode: inflated here from its Content-Encoding, within cap)
    ACCEPT_ENCODING                                 the Accept-Encoding header of a request read with decode=True
    is_redirect(status) -> bool                     a 3xx answer (the caller sent the request with
                                                    allow_redirects=False and decides: refuse it, or follow a target
                                                    it checked)

A compressed body is small on the wire and may be huge inflated (a gzip of zeros inflates a thousandfold): with
decode=True the caller's session does not inflate (aiohttp.ClientSession(auto_decompress=False)) and the body is
inflated here, never more than cap + 1 bytes of it held. Without it aiohttp inflates, which aiohttp >= 3.13.3 bounds
(CVE-2025-69223: before, a whole network chunk was inflated at once). aiohttp itself is imported by the callers,
where they open a session (this module loads without it).
"""

from __future__ import annotations

import zlib
from typing import Any

_READ_CHUNK = 1 << 16
ACCEPT_ENCODING = "gzip, deflate"
"""What a caller reading with decode=True accepts (aiohttp would also offer br or zstd when their packages are
installed, which read_bounded does not inflate)."""
_GZIP = ("gzip", "x-gzip")
MAX_GZIP_MEMBERS = 1024
"""gzip streams one body may hold, one after another (aiohttp's own bound)."""


async def read_bounded(response: Any, cap: int, *, decode: bool = False) -> bytes | None:
    """The body of an aiohttp response, or None as soon as it passes `cap` bytes (a declared length over it is not
    read at all); what was read is dropped with the connection. `decode`: the session was opened with
    auto_decompress=False; a gzip or deflate body is inflated here, None once the wire bytes or the inflated ones
    pass `cap`. ValueError (a phrase, for the caller's message) for another Content-Encoding or a damaged body."""
    encoding = (response.headers.get("Content-Encoding") or "").strip().lower()
    if encoding == "identity":
        encoding = ""
    if decode and encoding and encoding not in (*_GZIP, "deflate"):
        raise ValueError(f"answered with Content-Encoding {encoding!r}, which hsx does not decode (it asks for "
                         f"{ACCEPT_ENCODING}); serve it uncompressed")
    if response.content_length is not None and (decode or not encoding) and response.content_length > cap:
        return None
    body, wire = bytearray(), 0
    inflater = _Inflater(encoding, cap) if decode and encoding else None
    while chunk := await response.content.read(_READ_CHUNK):
        wire += len(chunk)
        if wire > cap:
            return None
        if inflater is None:
            body += chunk
        elif not inflater.feed(chunk, body):
            return None
        if len(body) > cap:
            return None
    if inflater is not None:
        inflater.finish()
    return bytes(body)


class _Inflater:
    """A gzip body (its members one after another, at most MAX_GZIP_MEMBERS) or a deflate one (zlib-wrapped or raw)
    inflated piece by piece, each call producing at most what is left under the cap plus one byte. Bytes after the
    last stream that start no gzip member are dropped, as aiohttp drops them."""

    def __init__(self, encoding: str, cap: int) -> None:
        self.encoding, self.cap = encoding, cap
        self.obj: Any = None  # the stream being inflated; None before the first byte and between gzip members
        self.members = 0
        self.between = b""  # bytes after a finished stream, too few yet to tell another gzip member from padding
        self.ignoring = False

    def feed(self, data: bytes, body: bytearray) -> bool:
        """Inflate `data` onto `body`; False once body passes the cap."""
        while data and not self.ignoring:
            if self.obj is None:
                data, self.between = self.between + data, b""
                if self.members and len(data) < 2:
                    self.between = data
                    return True
                if self.members and (self.encoding not in _GZIP or not data.startswith(b"\x1f\x8b")):
                    self.ignoring = True
                    return True
                self.members += 1
                if self.members > MAX_GZIP_MEMBERS:
                    raise ValueError(f"sent a gzip body of more than {MAX_GZIP_MEMBERS} members")
                # deflate: RFC 9110 says zlib-wrapped (its first byte's low bits 8), some servers send it raw
                wbits = 16 + zlib.MAX_WBITS if self.encoding in _GZIP else \
                    zlib.MAX_WBITS if data[0] & 0x0F == 8 else -zlib.MAX_WBITS
                self.obj = zlib.decompressobj(wbits)
            try:
                body += self.obj.decompress(data, self.cap + 1 - len(body))
            except zlib.error as e:
                raise ValueError(f"sent a damaged {self.encoding} body ({e})") from None
            if len(body) > self.cap:
                return False
            data = self.obj.unconsumed_tail
            if self.obj.eof:
                data, self.obj = self.obj.unused_data + data, None
        return True

    def finish(self) -> None:
        """ValueError when the body ended inside a stream."""
        if self.obj is not None:
            raise ValueError(f"sent a {self.encoding} body cut short")


def is_redirect(status: int) -> bool:
    """Whether an answer to a request sent with allow_redirects=False is a redirect (any 3xx): never followed
    unchecked."""
    return 300 <= status < 400
