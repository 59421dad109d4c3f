"""The OpenAI-server pool of `hsx regenerate` (jobs/server_pool.py) against aiohttp's own test servers on loopback, in
milliseconds: every kind of answer does to its request and its server what the module docstring says (set-aside and
back-off, retries, refusals, keys refused, answers that are not an API's, redirects, slots per server)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from jobs.server_pool import BadAnswer, NoServer, Pool, PoolSettings, Refused, Transient

OK = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "fine"}]}


def settings(**kw) -> PoolSettings:
    return PoolSettings(**{"concurrency": 4, "request_timeout_s": 5, "retries": 3, "server_wait_s": 5,
                           "answer_cap": 1 << 20, "retry_base_s": 0.001, **kw})


class Scripted:
    """A server that answers each POST with the next of `answers` (the last one repeats): (status, body, headers)
    or a callable(request) -> Response. `hits` counts POSTs; `in_flight` / `most_in_flight` count concurrent ones."""

    def __init__(self, *answers, delay: float = 0.0) -> None:
        self.answers, self.delay, self.hits, self.in_flight, self.most_in_flight = list(answers), delay, 0, 0, 0
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
        return web.json_response({"data": [{"id": "m"}]})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        answer = self.answers[min(self.hits, len(self.answers) - 1)]
        self.hits += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            if callable(answer):
                return answer(request)
            status, body, headers = (*answer, {})[:3]
            if isinstance(body, (dict, list)):
                return web.json_response(body, status=status, headers=headers)
            return web.Response(body=body, status=status, headers=headers)
        finally:
            self.in_flight -= 1


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
