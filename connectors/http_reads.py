"""Reading an HTTP answer from a peer hsx does not control (a server of `hsx regenerate`, an image URL): its bytes
bounded, and no redirect followed unless the caller checked where it goes.

    read_bounded(response, cap) -> bytes | None     an aiohttp response's body, or None once it passes cap
    is_redirect(status) -> bool                     a 3xx answer (the caller sent the request with
                                                    allow_redirects=False and decides: refuse it, or follow a target
                                                    it checked)

aiohttp itself is imported by the callers, where they open a session (this module loads without it).
"""

from __future__ import annotations

from typing import Any

_READ_CHUNK = 1 << 16


async def read_bounded(response: Any, cap: int) -> bytes | None:
    """The body of an aiohttp response, or None as soon as it passes `cap` bytes (a declared length over it is not
    read at all); what was read is dropped with the connection."""
    if response.content_length is not None and not response.headers.get("Content-Encoding") \
            and response.content_length > cap:
        return None
    body = bytearray()
    while chunk := await response.content.read(_READ_CHUNK):
        body += chunk
        if len(body) > cap:
            return None
    return bytes(body)


def is_redirect(status: int) -> bool:
    """Whether an answer to a request sent with allow_redirects=False is a redirect (any 3xx): never followed
    unchecked."""
    return 300 <= status < 400
