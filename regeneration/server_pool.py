"""A pool of OpenAI-compatible servers (vLLM, SGLang, `hsx serve`) that `hsx regenerate` sends its requests to:
slots per server, set-aside with back-off, retries, and answers it trusts no further than it can check.

    PoolSettings(api_key, concurrency, request_timeout_s, retries, server_wait_s, answer_cap, retry_base_s)
    Pool(urls, settings)             async context manager (one aiohttp session)
        .probe() -> {url: model ids}  GET /v1/models of each; ValueError naming the server and the fix
        .call(route, body) -> (answer JSON, server url)
        .servers                      Server per URL: free slots, back-off, answered count and seconds
    base_url(url) / error_message(raw)

What an answer does to its request and its server (in `call`):
    200 with an OpenAI body       the answer
    400, 413, 422                 Refused: the request itself (prompt too long, a bad field), same every time
    500, a timeout                Transient: tried again, `retries` times in all, exponential back-off
    408, 429, 503, no answer      the server is set aside (Retry-After, else a back-off growing to 30 s); the
                                  request moves to another server or waits, uncounted; NoServer when none answered
                                  for `server_wait_s`
    other 4xx (Ray Serve's 404 while an app redeploys)   set aside like a server that does not answer
    401, 403                      the server is set aside for good (it refuses the key)
    200 that is not an API's      the server is set aside for good
    3xx                           BadAnswer: no redirect is followed (a prompt goes only to a server /v1/models
                                  vouched for); the server stays in use
    more than `answer_cap` bytes  BadAnswer: read no further (an endless answer costs a bounded amount of memory)
A request goes to the live server with the most free slots; each server takes `concurrency` requests at once.
aiohttp is imported when a pool opens (this module's settings are read by the CLI's parser, which stays light).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential, wait_random

from connectors.http_reads import ACCEPT_ENCODING, is_redirect, read_bounded

logger = logging.getLogger(__name__)

REFUSALS = (400, 413, 422)
"""Answers that refuse the request itself (prompt too long, bad field): the record fails with the server's message,
the same way every time."""
BUSY = (408, 429, 503)
"""Answers of a server that is busy or unavailable now: set aside (Retry-After honoured)."""
MAX_BACK_OFF_S = 30.0


class Refused(Exception):
    """The server answered 4xx: this request fails the same way every time (its message is the record's error)."""


class Transient(Exception):
    """A 500, a timeout: the request is tried again (--retries)."""


class ServerGone(Exception):
    """The server did not answer (connection refused or reset) or is busy (503, 429): the request moves on,
    uncounted."""


class NoServer(Exception):
    """No server answered for --server-wait-s, or every server was set aside."""


class BadAnswer(Exception):
    """An answer this record cannot keep — over --max-answer-bytes, a redirect, more token ids than asked for, ids
    that do not decode to the text: the record fails (a re-run tries it again); the server stays in use."""


@dataclass(frozen=True)
class PoolSettings:
    """What the pool needs of a command's settings (hsx regenerate's: RegenerateConfig.pool_settings())."""

    api_key: str | None = None
    """Bearer key sent to every server."""
    concurrency: int = 32
    """Requests in flight per server."""
    request_timeout_s: float = 600.0
    """Longest wait for one answer (then Transient)."""
    retries: int = 5
    """Attempts of a request that gets a 500 or no answer in time."""
    server_wait_s: float = 300.0
    """How long requests wait for a server to answer again when none does (then NoServer)."""
    answer_cap: int = 8 << 20
    """Most bytes of one answer read (then BadAnswer)."""
    retry_base_s: float = 0.5
    """First wait between attempts; it doubles up to 30 s (plus up to half a second of jitter)."""
    probe_timeout_s: float = 30.0
    """Longest wait for a server's /v1/models."""


def base_url(url: str) -> str:
    """http://host:port[/prefix] -> http://host:port[/prefix]/v1."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--server {url!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8000")
    return url if url.endswith("/v1") else url + "/v1"


def error_message(raw: bytes) -> str:
    """The message of an error body: OpenAI's {"error": {"message"}}, vLLM's and SGLang's {"object": "error",
    "message"}, FastAPI's {"detail"}; else the body's start."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested past json's depth
        doc = None
    if isinstance(doc, dict):
        inner = doc.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"]
        for key in ("message", "detail", "error"):
            if isinstance(doc.get(key), str):
                return doc[key]
    text = raw.decode("utf-8", "replace").strip()
    return text[:300] or "(empty body)"


@dataclass
class Server:
    url: str
    """Base URL ending in /v1."""
    free: int
    down_until: float = 0.0
    misses: int = 0
    """Consecutive times it did not answer: its back-off grows with them."""
    broken: str | None = None
    """Why it was set aside for good (answers that are not an API's)."""
    answered: int = 0
    seconds: float = 0.0


class Pool:
    """The servers, their free slots and health (see the module docstring)."""

    def __init__(self, urls: list[str], settings: PoolSettings) -> None:
        self.settings = settings
        self.cap = settings.answer_cap
        self.servers = [Server(u, settings.concurrency) for u in urls]
        self.cond = asyncio.Condition()
        self.none_since: float | None = None
        """When the last live server went down (None while one answers)."""
        self.session = None

    async def __aenter__(self) -> Pool:
        import aiohttp

        s = self.settings
        headers = {"Accept-Encoding": ACCEPT_ENCODING}
        headers.update({"Authorization": f"Bearer {s.api_key}"} if s.api_key else {})
        limit = s.concurrency * len(self.servers) + 8
        # compressed answers are inflated by read_bounded within the cap (aiohttp's own inflater is not bounded by it)
        self.session = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=limit),
                                             timeout=aiohttp.ClientTimeout(total=s.request_timeout_s),
                                             auto_decompress=False)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def probe(self) -> dict[str, list[str]]:
        """{url: served model ids} of every server; ValueError naming the server and the fix when one cannot be
        used (does not answer, refuses the key, answers something that is not an OpenAI API)."""
        import aiohttp

        out = {}
        for s in self.servers:
            try:
                async with self.session.get(s.url + "/models", allow_redirects=False,
                                            timeout=aiohttp.ClientTimeout(total=self.settings.probe_timeout_s)) as r:
                    raw = await read_bounded(r, self.cap, decode=True)
                    status, location = r.status, r.headers.get("Location", "")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                raise ValueError(f"--server {s.url}: no answer ({type(e).__name__}: {e or 'timed out'}); start the "
                                 "server first, or fix the URL") from None
            except ValueError as e:  # a body hsx cannot decode
                raise ValueError(f"--server {s.url}: GET /v1/models {e}") from None
            if raw is None:
                raise ValueError(f"--server {s.url}: GET /v1/models answered more than {self.cap} bytes "
                                 "(--max-answer-bytes); is it an OpenAI-compatible server (vLLM, SGLang, hsx serve)?")
            if is_redirect(status):
                raise ValueError(f"--server {s.url}: GET /v1/models answered {status}, a redirect to {location!r}; "
                                 "hsx regenerate follows no redirects: pass the server it redirects to as --server")
            if status in (401, 403):
                raise ValueError(f"--server {s.url} refuses the API key ({status}: {error_message(raw)}); pass the "
                                 "server's key with --api-key or $HSX_REGENERATE_API_KEY")
            if status != 200:
                raise ValueError(f"--server {s.url}: GET /v1/models answered {status} ({error_message(raw)}); is it an "
                                 "OpenAI-compatible server (vLLM, SGLang, hsx serve)?")
            try:
                doc = json.loads(raw)
                ids = [m["id"] for m in doc["data"]]
                if not all(isinstance(i, str) for i in ids):
                    raise TypeError("model ids are not strings")
            except (ValueError, KeyError, TypeError, RecursionError) as e:
                raise ValueError(f"--server {s.url}: GET /v1/models did not answer an OpenAI model list ({e}; body "
                                 f"starts {raw[:80]!r}); point --server at an OpenAI-compatible server") from None
            out[s.url] = ids
        return out

    async def call(self, route: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """(the JSON answer, the URL of the server that gave it) to POST `route`. Raises Refused (4xx), Transient
        (--retries used up), NoServer, BadAnswer (over the cap, a redirect)."""
        s = self.settings
        retrying = AsyncRetrying(stop=stop_after_attempt(s.retries), reraise=True,
                                 wait=wait_exponential(multiplier=s.retry_base_s, max=MAX_BACK_OFF_S)
                                 + wait_random(0, s.retry_base_s),
                                 retry=retry_if_exception_type(Transient))
        async for attempt in retrying:
            with attempt:
                while True:
                    server = await self._acquire()
                    try:
                        return await self._post(server, route, body), server.url
                    except ServerGone:
                        continue  # set aside: the request waits for this server or another, uncounted
                    finally:
                        await self._release(server)
        raise AssertionError("unreachable")

    async def _acquire(self) -> Server:
        loop = asyncio.get_running_loop()
        async with self.cond:
            while True:
                now = loop.time()
                usable = [s for s in self.servers if s.broken is None]
                if not usable:
                    raise NoServer("every server was set aside: " + "; ".join(
                        f"{s.url}: {s.broken}" for s in self.servers))
                live = [s for s in usable if s.down_until <= now]
                ready = [s for s in live if s.free > 0]
                if ready:
                    server = max(ready, key=lambda s: s.free)
                    server.free -= 1
                    return server
                if self.none_since is not None and now - self.none_since > self.settings.server_wait_s:
                    raise NoServer(f"no server answered for {self.settings.server_wait_s:g} s (--server-wait-s): "
                                   + ", ".join(s.url for s in usable))
                wake = min([1.0, *(s.down_until - now for s in usable if s.down_until > now)])
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.cond.wait(), timeout=max(wake, 0.01))

    async def _release(self, server: Server) -> None:
        async with self.cond:
            server.free += 1
            self.cond.notify_all()

    def _set_aside(self, server: Server, seconds: float | None = None, why: str = "") -> None:
        loop = asyncio.get_running_loop()
        server.misses += 1
        back_off = min(MAX_BACK_OFF_S, 0.5 * 2 ** min(server.misses - 1, 6)) if seconds is None else seconds
        server.down_until = loop.time() + back_off
        if server.misses == 1 and why:
            logger.warning("%s: %s; its requests move to the other servers (or wait for it)", server.url, why)
        now = loop.time()
        if self.none_since is None and all(s.broken or s.down_until > now for s in self.servers):
            self.none_since = now

    async def _post(self, server: Server, route: str, body: dict[str, Any]) -> dict[str, Any]:
        import aiohttp

        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            async with self.session.post(server.url + route, json=body, allow_redirects=False) as r:
                raw = await read_bounded(r, self.cap, decode=True)
                status, retry_after = r.status, r.headers.get("Retry-After", "")
                location = r.headers.get("Location", "")
        except asyncio.TimeoutError:
            raise Transient(f"{server.url}: no answer within {self.settings.request_timeout_s:g} s "
                            "(--request-timeout-s)") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
            self._set_aside(server, why=f"no answer ({type(e).__name__}: {e})")
            raise ServerGone(str(e)) from None
        except ValueError as e:  # a Content-Encoding hsx does not decode, or a damaged compressed body
            raise BadAnswer(f"{server.url} {e}") from None
        if raw is None:  # read no further: an endless or huge answer would take the driver's memory
            raise BadAnswer(f"{server.url} answered {status} with more than {self.cap} bytes; the answer was dropped "
                            "(raise --max-answer-bytes if the server's answers are that long)")
        if is_redirect(status):  # followed, the prompt would go to a server never checked (or never named)
            raise BadAnswer(f"{server.url} answered {status}, a redirect to {location[:200]!r}; hsx regenerate "
                            "follows no redirects: pass the server it redirects to as --server")
        if status in BUSY:
            wait = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else None
            self._set_aside(server, wait, why=f"busy or unavailable ({status}: {error_message(raw)[:200]})")
            raise ServerGone(f"{status}") from None
        if status >= 500:
            raise Transient(f"{server.url} answered {status}: {error_message(raw)}")
        if status in (401, 403):
            server.broken = f"refused the API key ({status}: {error_message(raw)[:200]})"
            logger.error("%s %s; set aside", server.url, server.broken)
            raise ServerGone(server.broken)
        if status in REFUSALS:  # the request itself: prompt too long, a bad field
            raise Refused(f"{server.url} answered {status}: {error_message(raw)}")
        if status != 200:  # 404 and the like: the server is not serving the route now (Ray Serve's proxy answers 404
            # while its app (re)deploys): set aside like a server that does not answer
            self._set_aside(server, why=f"answered {status} ({error_message(raw)[:200]})")
            raise ServerGone(f"{status}")
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list) or not doc["choices"]:
                raise ValueError("no 'choices' list")
        except (ValueError, RecursionError) as e:  # RecursionError: nested past json's depth
            server.broken = f"answered 200 with what is not an OpenAI completion ({e}; body starts {raw[:80]!r})"
            logger.error("%s %s; set aside for good", server.url, server.broken)
            raise ServerGone(server.broken) from None
        server.misses, server.answered = 0, server.answered + 1
        server.seconds += loop.time() - start
        self.none_since = None
        return doc
