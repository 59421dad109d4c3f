"""Fetching an image URL (http, https) for extractor.media: under one deadline, to allowed hosts only, a bounded
number of bytes, redirects followed only where they were allowed.

    fetch_image(url, where, *, domains, timeout_s, cap) -> bytes
    ImageUnavailable        a ValueError: the URL could not be fetched now (connection failed, 408, 429, 5xx, or the
                            deadline passed); another try may succeed (a job records it as retried by a re-run).
                            A certificate that fails verification is not (a plain ValueError: settled, one try)
    host_of(url) -> str     the host a URL connects to, lower-cased ("" when it has none)

The rules, in the order they apply:
    host                    with `domains` set, the URL's host must be one of them (matched exactly, as vLLM
                            matches --allowed-media-domains); nothing is connected to otherwise
    deadline                connect, redirects, retries and the whole body within `timeout_s` seconds (a server
                            dripping one byte a second is cut off there, not after a per-read timeout per byte)
    redirects               never followed without `domains`; with them, followed (at most MAX_REDIRECTS) only to
                            an http(s) URL whose host is one of them; never to another scheme
    retries                 a connection failure, 408, 429 or 5xx is tried again, FETCH_ATTEMPTS tries in all with
                            a short exponential back-off (tenacity), all within the deadline
    body                    200 only, read through connectors.http_reads.read_bounded: at most `cap` bytes on the
                            wire, and a gzip or deflate body inflated by hsx (not aiohttp) to at most `cap` bytes
Errors say "cannot be fetched (connection failed)", or the HTTP status of the URL asked, and never more of what lies
behind it (a caller cannot tell a closed port from an unreachable host); an https host whose certificate fails
verification is named as such (the same answer every time: not tried again). aiohttp is imported on the first fetch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence

from connectors.http_reads import ACCEPT_ENCODING, is_redirect, read_bounded

FETCH_ATTEMPTS = 3
"""Tries of one URL whose failure may pass (connection failed, 408, 429, 5xx)."""
FETCH_RETRY_BASE_S = 0.25
"""The first back-off between tries; it doubles (at most 2 s)."""
MAX_REDIRECTS = 5
"""Redirects followed (only to allowed hosts) before the URL is refused."""
TRANSIENT_STATUS = (408, 429)
"""Statuses besides 5xx that say "not now": tried again."""


class ImageUnavailable(ValueError):
    """An image URL that could not be fetched now (connection failed, 408, 429, 5xx, the deadline passed): a later
    try may succeed, so a job does not settle the sample (a re-run retries it)."""


class _Transient(Exception):
    """One try's failure that another try may not repeat; its text is the reason shown."""


def host_of(url) -> str:
    """The host `url` (a string or a yarl.URL) connects to, lower-cased ("" without one)."""
    from yarl import URL

    return ((url if isinstance(url, URL) else URL(url)).host or "").lower()


def fetch_image(url: str, where: str, *, domains: Sequence[str] | None, timeout_s: float, cap: int) -> bytes:
    """The bytes at `url` by the module's rules; ValueError (ImageUnavailable where a later try may succeed) names
    the image and the fix. Runs its own event loop (on a helper thread when the caller's thread runs one)."""
    shown = url if len(url) <= 200 else url[:200] + "..."
    try:
        host = host_of(url)
    except (ValueError, TypeError):
        raise ValueError(f"{where}: image URL {shown!r} is not a valid URL") from None
    if not host:
        raise ValueError(f"{where}: image URL {shown!r} has no host")
    if domains and host not in domains:
        raise ValueError(f"{where}: image URL {shown!r} is on host {host!r}, which is not in allowed_media_domains "
                         f"({', '.join(domains)}); add the host there, or give the image as a file or data: URL")
    return _run(_fetch(url, shown, where, tuple(domains or ()), timeout_s, cap))


def _run(coro):
    """Run the fetch on an event loop of its own (in a thread when the caller is in one). Not asyncio.run: at its end
    it waits for its executor, where aiohttp resolves host names, so a name server that never answers would outlast
    the deadline; this loop's executor is let go unfinished (its lookup ends in the background)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_here(coro)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hsx-image-fetch")
    try:
        return pool.submit(_run_here, coro).result()
    finally:
        pool.shutdown(wait=False)


def _run_here(coro):
    loop = asyncio.new_event_loop()
    lookups = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hsx-image-dns")
    loop.set_default_executor(lookups)
    try:
        return loop.run_until_complete(coro)
    finally:
        lookups.shutdown(wait=False, cancel_futures=True)
        loop.close()


async def _fetch(url: str, shown: str, where: str, domains: tuple[str, ...], timeout_s: float, cap: int) -> bytes:
    from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

    tries = 0

    async def tried() -> bytes:
        nonlocal tries
        import aiohttp

        # trust_env: HTTP(S)_PROXY / NO_PROXY as urllib and vLLM's client honour them (hosts are checked on the URL);
        # auto_decompress off: read_bounded inflates a compressed body itself, within the cap
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), trust_env=True,
                                         auto_decompress=False) as session:
            retrying = AsyncRetrying(stop=stop_after_attempt(FETCH_ATTEMPTS), reraise=True,
                                     wait=wait_exponential(multiplier=FETCH_RETRY_BASE_S, max=2.0),
                                     retry=retry_if_exception_type(_Transient))
            async for attempt in retrying:
                with attempt:
                    tries += 1
                    return await _get(session, url, shown, where, domains, cap)
        raise AssertionError("unreachable")

    try:
        return await asyncio.wait_for(tried(), timeout_s)
    except asyncio.TimeoutError:
        raise ImageUnavailable(f"{where}: image URL {shown!r} was not fetched within {timeout_s:g} s "
                               "(image_fetch_timeout_s, $VLLM_IMAGE_FETCH_TIMEOUT); try again, or raise the "
                               "limit") from None
    except _Transient as e:
        raise ImageUnavailable(f"{where}: image URL {shown!r} cannot be fetched ({e}; {tries} tries)") from None


async def _get(session, url: str, shown: str, where: str, domains: tuple[str, ...], cap: int) -> bytes:
    """One try: the URL and the redirects it may take, to a 200's body."""
    import aiohttp
    from yarl import URL

    target = URL(url)
    for _ in range(MAX_REDIRECTS + 1):
        try:
            async with session.get(target, allow_redirects=False, headers={"Accept-Encoding": ACCEPT_ENCODING}) as r:
                if is_redirect(r.status):
                    target = _redirect(target, r.status, r.headers.get("Location"), shown, where, domains)
                    continue
                if r.status in TRANSIENT_STATUS or r.status >= 500:
                    raise _Transient(f"HTTP {r.status}")
                if r.status != 200:
                    raise ValueError(f"{where}: image URL {shown!r} cannot be fetched (HTTP {r.status})")
                encoding = r.headers.get("Content-Encoding", "")
                try:
                    body = await read_bounded(r, cap, decode=True)
                except ValueError as e:  # an encoding hsx does not inflate, a damaged compressed body
                    raise ValueError(f"{where}: image URL {shown!r} {e}") from None
        except aiohttp.InvalidURL:
            raise ValueError(f"{where}: image URL {shown!r} is not a valid URL") from None
        except aiohttp.ClientConnectorCertificateError as e:  # the same answer every time: refused, not retried
            why = getattr(e.certificate_error, "verify_message", "") or type(e.certificate_error).__name__
            raise ValueError(f"{where}: image URL {shown!r}: the certificate of host {host_of(target)!r} failed "
                             f"verification ({why}); fix the server's certificate (a private CA: name its file in "
                             "$SSL_CERT_FILE), or give the image as a file or data: URL") from None
        except (aiohttp.ClientError, OSError):  # refused, reset, unreachable, other TLS, not HTTP: all one answer
            raise _Transient("connection failed") from None
        if body is None:
            decoded = f" once its Content-Encoding {encoding} is decoded" if encoding else ""
            raise ValueError(f"{where}: image URL {shown!r} is larger than {cap >> 20} MiB{decoded}")
        return body
    raise ValueError(f"{where}: image URL {shown!r} redirects more than {MAX_REDIRECTS} times; give the URL it ends "
                     "at")


def _redirect(current, status: int, location: str | None, shown: str, where: str, domains: tuple[str, ...]):
    """Where a redirect goes, when it may be followed; else ValueError."""
    from yarl import URL

    if not domains:
        raise ValueError(f"{where}: image URL {shown!r} answered {status}, a redirect, which is not followed without "
                         "allowed_media_domains; give the URL it redirects to, or list the hosts it may redirect to "
                         "in allowed_media_domains")
    try:
        target = current.join(URL(location or ""))
        host = host_of(target)
    except (ValueError, TypeError):
        target, host = None, ""
    if not location or target is None or target.scheme not in ("http", "https") or host not in domains:
        scheme = target.scheme if target is not None else ""
        raise ValueError(f"{where}: image URL {shown!r} answered {status}, a redirect to "
                         f"{f'{scheme}://{host}' if host else 'no usable URL'}, which is not an http(s) host in "
                         f"allowed_media_domains ({', '.join(domains)}); not followed")
    return target
