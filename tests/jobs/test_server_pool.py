"""The OpenAI-server pool of `hsx regenerate` (regeneration/server_pool.py) against aiohttp's own test servers on loopback, in
milliseconds, without an `hsx serve`: every kind of answer does to its request and its server what the module
docstring's table says — 408/429/503 and other 4xx set the server aside for a while (Retry-After honoured, else a
back-off growing to 30 s) and the request moves on, as when a server refuses connections; 400/413/422 fail the request
once with the server's message; 500s and answers not in time are retried, then fail; 401/403 and answers that are not
an API's set the server aside for good; redirects and answers over the cap fail the request, the server stays; an
answer resets the back-off. Slots per server, the server with the most free slots first, the key, the probe's
refusals, the error bodies of every server kind. Each rule was checked by hand against a mutated pool."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from regeneration.server_pool import (
    BadAnswer,
    NoServer,
    Pool,
    PoolSettings,
    Refused,
    Transient,
    base_url,
    error_message,
)

pytestmark = pytest.mark.timeout(60)  # a pool that loops on a server it should set aside fails, not hangs

OK = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "fine"}]}


def settings(**kw) -> PoolSettings:
    return PoolSettings(**{"concurrency": 4, "request_timeout_s": 5, "retries": 3, "server_wait_s": 5,
                           "answer_cap": 1 << 20, "retry_base_s": 0.001, **kw})


class Scripted:
    """A server that answers each POST with the next of `answers` (the last one repeats): (status, body, headers)
    or a callable(request) -> Response. `hits` counts POSTs; `in_flight` / `most_in_flight` count concurrent ones."""

    def __init__(self, *answers, delay: float = 0.0, models=(200, {"data": [{"id": "m"}]})) -> None:
        self.answers, self.delay, self.hits, self.in_flight, self.most_in_flight = list(answers), delay, 0, 0, 0
        self.models_answer = models
        """What GET /v1/models answers: (status, body[, headers])."""
        self.keys: list[str | None] = []
        """The Authorization header of each POST."""
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_get("/v1/models", self.models)
        self.server = TestServer(app, host="127.0.0.1")
        self.url = ""
        """Its base URL (http://127.0.0.1:PORT/v1), once started."""

    async def start(self) -> None:
        await self.server.start_server()
        self.url = str(self.server.make_url("/v1"))

    async def models(self, request: web.Request) -> web.Response:
        return _response(self.models_answer)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        answer = self.answers[min(self.hits, len(self.answers) - 1)]
        self.hits += 1
        self.keys.append(request.headers.get("Authorization"))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            return answer(request) if callable(answer) else _response(answer)
        finally:
            self.in_flight -= 1


def _response(answer) -> web.Response:
    status, body, headers = (*answer, {})[:3]
    if isinstance(body, (dict, list)):
        return web.json_response(body, status=status, headers=headers)
    return web.Response(body=body, status=status, headers=headers)


def run(*servers: Scripted, scenario, **kw):
    """Start the servers, open a pool over them, run `scenario(pool)`; its result."""
    async def main():
        for s in servers:
            await s.start()
        try:
            async with Pool([s.url for s in servers], settings(**kw)) as pool:
                return await scenario(pool)
        finally:
            for s in servers:
                await s.server.close()

    return asyncio.run(main())


def test_a_busy_server_is_set_aside_and_its_request_moves_to_the_other():
    busy, fair = Scripted((503, {"error": {"message": "overloaded"}}, {"Retry-After": "5"})), Scripted((200, OK))

    async def scenario(pool):
        doc, url = await pool.call("/completions", {"prompt": "x"})
        loop = asyncio.get_running_loop()
        return doc, url, pool.servers[0].down_until - loop.time(), pool.servers[0].misses

    # the busier server is tried first only when it has more free slots: give it more
    doc, url, down_for, misses = run(busy, fair, scenario=lambda p: _first_to(p, 0, scenario))
    assert doc == OK and url == fair.url and busy.hits == 1 and misses == 1 and 4 < down_for <= 5


async def _first_to(pool, index: int, scenario):
    pool.servers[index].free += 1  # most free slots: picked first
    return await scenario(pool)


def test_a_refusal_fails_the_request_with_the_servers_own_message():
    refusing = Scripted((413, {"error": {"message": "the prompt is 9000 tokens, more than 4096"}}))
    with pytest.raises(Refused, match="answered 413: the prompt is 9000 tokens, more than 4096"):
        run(refusing, scenario=lambda p: p.call("/completions", {}))
    assert refusing.hits == 1  # never retried: it fails the same way every time


def test_a_500_is_retried_with_back_off_and_given_up_after_the_retries():
    flaky = Scripted((500, "boom"), (500, "boom"), (200, OK))
    doc, _ = run(flaky, scenario=lambda p: p.call("/completions", {}), retries=3)
    assert doc == OK and flaky.hits == 3
    broken = Scripted((500, {"detail": "out of memory"}))
    with pytest.raises(Transient, match="answered 500: out of memory"):
        run(broken, scenario=lambda p: p.call("/completions", {}), retries=2)
    assert broken.hits == 2


@pytest.mark.parametrize("answer,why", [
    ((401, {"error": {"message": "bad key"}}), "refused the API key (401: bad key)"),
    ((200, "<html>a login page</html>"), "answered 200 with what is not an OpenAI completion"),
    ((200, b"[" * 100_000), "not an OpenAI completion (maximum recursion depth"),
])
def test_a_refused_key_or_an_answer_that_is_not_an_apis_sets_the_server_aside_for_good(answer, why):
    server = Scripted(answer)
    with pytest.raises(NoServer, match=r"every server was set aside: .*" + why.replace("(", r"\(").replace(")", r"\)")):
        run(server, scenario=lambda p: p.call("/completions", {}))
    assert server.hits == 1


def test_requests_wait_for_a_server_that_comes_back_and_fail_only_after_server_wait_s():
    back = Scripted((503, "busy", {"Retry-After": "0.05"}), (200, OK))
    doc, _ = run(back, scenario=lambda p: p.call("/completions", {}))
    assert doc == OK and back.hits == 2
    gone = Scripted((503, "busy", {"Retry-After": "0.05"}))
    started = time.monotonic()
    with pytest.raises(NoServer, match=r"no server answered for 0.3 s \(--server-wait-s\)"):
        run(gone, scenario=lambda p: p.call("/completions", {}), server_wait_s=0.3)
    assert time.monotonic() - started < 5


def test_a_redirect_or_an_answer_over_the_cap_fails_the_request_and_the_server_stays_in_use():
    tricky = Scripted((307, "", {"Location": "http://elsewhere.invalid/v1/completions"}), (200, {"x": "y" * 5000}),
                      (200, OK))

    async def scenario(pool):
        with pytest.raises(BadAnswer, match="a redirect to 'http://elsewhere.invalid"):
            await pool.call("/completions", {})
        with pytest.raises(BadAnswer, match="with more than 2048 bytes"):
            await pool.call("/completions", {})
        return await pool.call("/completions", {}), pool.servers[0].broken

    (doc, _), broken = run(tricky, scenario=scenario, answer_cap=2048)
    assert doc == OK and broken is None and tricky.hits == 3


def test_each_server_takes_its_slots_and_no_more():
    slow_a, slow_b = Scripted((200, OK), delay=0.05), Scripted((200, OK), delay=0.05)

    async def scenario(pool):
        return await asyncio.gather(*(pool.call("/completions", {}) for _ in range(12)))

    answers = run(slow_a, slow_b, scenario=scenario, concurrency=2)
    assert len(answers) == 12 and slow_a.hits + slow_b.hits == 12
    assert slow_a.most_in_flight == 2 and slow_b.most_in_flight == 2  # both used, neither past its slots


def test_a_server_that_does_not_answer_backs_off_longer_each_time():
    async def scenario(pool):
        loop = asyncio.get_running_loop()
        server, waits = pool.servers[0], []
        for _ in range(9):
            pool._set_aside(server)
            waits.append(round(server.down_until - loop.time(), 1))
        return waits

    assert run(Scripted((200, OK)), scenario=scenario) == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_probe_names_each_servers_models():
    server = Scripted((200, OK))
    assert run(server, scenario=lambda p: p.probe()) == {server.url: ["m"]}


class Gone:
    """A server that is not there: connections to its port are refused."""

    def __init__(self) -> None:
        self.server, self.hits, self.url = self, 0, ""

    async def start(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"

    async def close(self) -> None:
        pass


def _moved_to_the_other(first, **kw):
    """`first` is tried first (it has the most free slots); a fair server beside it. (answer, url, seconds `first` is
    set aside for, its misses, why it was set aside for good)."""
    fair = Scripted((200, OK))

    async def scenario(pool):
        pool.servers[0].free += 1
        doc, url = await pool.call("/completions", {"prompt": "x"})
        s = pool.servers[0]
        return doc, url, s.down_until - asyncio.get_running_loop().time(), s.misses, s.broken

    doc, url, down_for, misses, broken = run(first, fair, scenario=scenario, **kw)
    assert doc == OK and url == fair.url and fair.hits == 1
    return down_for, misses, broken


@pytest.mark.parametrize("answer,down_for", [
    ((408, "request timeout", {"Retry-After": "2"}), (1.9, 2.0)),
    ((408, "request timeout"), (0.4, 0.5)),  # no Retry-After: the first back-off, half a second
    ((429, {"error": {"message": "rate limited"}}, {"Retry-After": "3"}), (2.9, 3.0)),
    ((429, "slow down"), (0.4, 0.5)),
    ((503, "unavailable", {"Retry-After": "1.5"}), (1.4, 1.5)),
    ((503, "unavailable", {"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}), (0.4, 0.5)),  # a date: the back-off
    ((404, {"detail": "Not Found"}), (0.4, 0.5)),  # Ray Serve's proxy while the app (re)deploys
    ((405, "method not allowed"), (0.4, 0.5)),  # any other 4xx alike
])
def test_a_busy_or_unavailable_server_is_set_aside_for_a_while_and_the_request_moves_on(answer, down_for):
    first = Scripted(answer)
    waited, misses, broken = _moved_to_the_other(first)
    assert first.hits == 1 and misses == 1 and broken is None  # only for a while
    assert down_for[0] < waited <= down_for[1]


def test_a_server_that_refuses_connections_is_set_aside_and_the_request_moves_on():
    waited, misses, broken = _moved_to_the_other(Gone())
    assert misses == 1 and broken is None and 0.4 < waited <= 0.5


@pytest.mark.parametrize("status,body,message", [
    (400, {"object": "error", "message": "'top_p' must be in (0, 1]"}, "'top_p' must be in (0, 1]"),  # vLLM, SGLang
    (413, {"error": {"message": "body too large"}}, "body too large"),  # OpenAI's shape
    (422, {"detail": "field required: messages"}, "field required: messages"),  # FastAPI's
    (400, "plain text reason", "plain text reason"),
])
def test_every_refusal_fails_the_request_once_with_the_message_and_keeps_the_server(status, body, message):
    refusing = Scripted((status, body))

    async def scenario(pool):
        with pytest.raises(Refused) as e:
            await pool.call("/completions", {})
        return str(e.value), pool.servers[0]

    error, server = run(refusing, scenario=scenario)
    assert error == f"{refusing.url} answered {status}: {message}"
    assert refusing.hits == 1 and server.misses == 0 and server.down_until == 0 and server.broken is None


@pytest.mark.parametrize("answer,why", [
    ((401, {"error": {"message": "bad key"}}), "refused the API key (401: bad key)"),
    ((403, {"detail": "forbidden"}), "refused the API key (403: forbidden)"),
    ((200, {"object": "list", "data": []}), "answered 200 with what is not an OpenAI completion (no 'choices' list"),
])
def test_a_server_set_aside_for_good_gets_no_more_requests_while_the_others_answer(answer, why):
    bad, fair = Scripted(answer), Scripted((200, OK))

    async def scenario(pool):
        pool.servers[0].free += 1
        urls = [(await pool.call("/completions", {}))[1] for _ in range(5)]
        return urls, pool.servers[0].broken

    urls, broken = run(bad, fair, scenario=scenario)
    assert urls == [fair.url] * 5 and bad.hits == 1 and broken.startswith(why)


def test_an_answer_after_misses_resets_the_back_off_and_the_wait_for_a_server():
    flaky = Scripted((503, "busy", {"Retry-After": "0.01"}), (503, "busy", {"Retry-After": "0.01"}), (200, OK))

    async def scenario(pool):
        doc, _ = await pool.call("/completions", {})
        return doc, pool.servers[0].misses, pool.none_since, pool.servers[0].answered

    doc, misses, none_since, answered = run(flaky, scenario=scenario)
    assert doc == OK and flaky.hits == 3 and misses == 0 and none_since is None and answered == 1


def test_no_answer_in_time_is_retried_and_then_fails_the_request():
    slow = Scripted((200, OK), delay=1.0)
    started = time.monotonic()
    with pytest.raises(Transient, match=r"no answer within 0.1 s \(--request-timeout-s\)"):
        run(slow, scenario=lambda p: p.call("/completions", {}), request_timeout_s=0.1, retries=2)
    assert slow.hits == 2 and time.monotonic() - started < 5


def test_the_key_goes_to_every_server_as_a_bearer_token():
    keyed, plain = Scripted((200, OK)), Scripted((200, OK))
    run(keyed, scenario=lambda p: p.call("/completions", {}), api_key="sk-test")
    run(plain, scenario=lambda p: p.call("/completions", {}))
    assert keyed.keys == ["Bearer sk-test"] and plain.keys == [None]


@pytest.mark.parametrize("models,why", [
    ((401, {"error": {"message": "bad key"}}), r"refuses the API key \(401: bad key\); pass the server's key"),
    ((403, "no"), r"refuses the API key \(403: no\)"),
    ((500, {"detail": "broken"}), r"GET /v1/models answered 500 \(broken\); is it an OpenAI-compatible server"),
    ((404, "nothing here"), r"GET /v1/models answered 404 \(nothing here\)"),
    ((302, "", {"Location": "http://elsewhere.invalid/v1/models"}),
     r"a redirect to 'http://elsewhere.invalid/v1/models'; hsx regenerate follows no redirects"),
    ((200, "<html>hello</html>"), r"did not answer an OpenAI model list"),
    ((200, {"data": [{"name": "m"}]}), r"did not answer an OpenAI model list \('id'"),
    ((200, {"data": [{"id": 7}]}), r"did not answer an OpenAI model list \(model ids are not strings"),
    ((200, {"data": [{"id": "x" * 5000}]}), r"answered more than 2048 bytes \(--max-answer-bytes\)"),
])
def test_probe_refuses_a_server_it_cannot_use_naming_it_and_the_fix(models, why):
    server = Scripted((200, OK), models=models)
    with pytest.raises(ValueError, match=r"--server http://127\.0\.0\.1:\d+/v1.*" + why):
        run(server, scenario=lambda p: p.probe(), answer_cap=2048)


def test_probe_of_a_server_that_is_not_there_says_to_start_it():
    with pytest.raises(ValueError, match=r"no answer \(.*\); start the server first, or fix the URL"):
        run(Gone(), scenario=lambda p: p.probe())


def test_a_request_goes_to_the_live_server_with_the_most_free_slots():
    a, b = Scripted((200, OK), delay=0.2), Scripted((200, OK), delay=0.2)

    async def scenario(pool):
        first = asyncio.create_task(pool.call("/completions", {}))  # a tie: the first server
        while a.in_flight == 0:
            await asyncio.sleep(0.005)
        second = await pool.call("/completions", {})  # a has one slot taken, b none: b
        return (await first)[1], second[1]

    assert run(a, b, scenario=scenario, concurrency=2) == (a.url, b.url)
    assert a.hits == 1 and b.hits == 1


def test_a_server_url_is_its_v1_base_with_or_without_v1_given():
    assert base_url(" http://h:8000/ ") == "http://h:8000/v1"
    assert base_url("https://h/prefix/v1/") == "https://h/prefix/v1"
    with pytest.raises(ValueError, match=r"--server 'h:8000' is not an http\(s\) URL; pass e.g. http://127.0.0.1:8000"):
        base_url("h:8000")


@pytest.mark.parametrize("raw,message", [
    (b'{"error": {"message": "openai"}}', "openai"),
    (b'{"object": "error", "message": "vllm"}', "vllm"),
    (b'{"detail": "fastapi"}', "fastapi"),
    (b'{"error": "flat"}', "flat"),
    (b"  <html>oops</html>  ", "<html>oops</html>"),
    (b"", "(empty body)"),
    (b"x" * 500, "x" * 300),
])
def test_an_error_body_says_its_message_in_every_shape_servers_use(raw, message):
    assert error_message(raw) == message
