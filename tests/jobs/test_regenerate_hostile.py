"""`hsx regenerate` against servers that do not play fair, each a real aiohttp server of the test's own on loopback
(in-process, its own event loop in a thread), which answers the records of a corpus well except the one the mode
names: an endless answer (the driver's memory stays bounded), an answer over the size cap, more token ids than
asked for, ids that do not decode to the answer's text, a 307 to another server (which must see nothing). Each time
the regeneration finishes, the hostile record alone fails with one line naming the record, the server and the limit,
and every other record is ok. Also: --output inside a model or a run, or a resume with another corpus, exits 2;
the following reader (hsx run --regenerate-with) stops when the regeneration's lease is gone without finished.json;
a regenerated corpus's record over the corpus record limit fails alone."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time

import psutil
import pytest
from aiohttp import web

from cli.main import main
from connectors.manifest import FAILED, OK, read_manifest
from connectors.run import RunDir
from corpus.readers import read_records
from corpus.records import CorpusFile
from corpus.regenerated import FINISHED, REGEN_JSON, PartWriter
from regeneration.config import RegenerateConfig
from regeneration.regenerate import regenerate
from regeneration.regenerator import Outcome

MAX_TOKENS = 48
GOOD = " the quick fox"
MODEL = "hostile-model"
ENDLESS_STOP = 256 << 20
GZIP_BOMB = gzip.compress(b" " * (64 << 20), compresslevel=9)  # inflates past any --max-answer-bytes a test sets
"""The endless answer stops here all the same, so that a driver that reads it whole fails the test, not the box."""


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from reference.tiny_models import build_tokenizer

    out = str(tmp_path_factory.mktemp("tokenizer"))
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


class Server:
    """An OpenAI-compatible server on 127.0.0.1: answers GOOD (with its ids) to every prompt, except a prompt naming a
    mode ("mode=endless", ...), which gets that mode's hostile answer. `posts` counts the completions it was asked
    for. `redirect_to`: where "mode=redirect" is sent with a 307."""

    def __init__(self, tok, redirect_to: str | None = None) -> None:
        self.tok, self.redirect_to, self.posts = tok, redirect_to, 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "the test server did not start"

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application(client_max_size=1 << 20)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.posts += 1
        body = await request.json()
        prompt = body["prompt"]
        mode = prompt.split("mode=", 1)[1].split()[0] if "mode=" in prompt else "good"
        choice = {"index": 0, "text": GOOD.strip(), "finish_reason": "stop", "prompt_token_ids": self.ids(prompt),
                  "token_ids": self.ids(GOOD) + [self.tok.eos_token_id]}  # the end of turn: a special token
        if mode == "endless":  # a 200 that never ends (until ENDLESS_STOP, or the client hangs up)
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(b'{"choices": [{"index": 0, "text": "')
            chunk, sent = b"a" * (1 << 16), 0
            try:
                while sent < ENDLESS_STOP:
                    await response.write(chunk)
                    sent += len(chunk)
                await response.write(b'"}]}')
            except (ConnectionError, RuntimeError):
                pass  # the client hung up: what hsx does with an answer too long
            return response
        if mode == "oversized":  # a whole, valid answer of 12 MiB (Content-Length says so up front)
            choice["text"] = "fox " * (3 << 20)
        elif mode == "more_ids":  # 200,000 ids for max_tokens 48
            choice["token_ids"] = (self.ids(GOOD) * 50_000)[:200_000]
        elif mode == "mismatch":  # ids that are not the text's
            choice["text"], choice["token_ids"] = "hello", [300, 301, 302, 303]
        elif mode == "redirect":
            raise web.HTTPTemporaryRedirect(self.redirect_to + "/v1/completions")
        elif mode == "gzipbomb":  # 64 KiB on the wire, 64 MiB inflated
            return web.Response(body=GZIP_BOMB, headers={"Content-Encoding": "gzip"}, content_type="application/json")
        elif mode == "br":  # an encoding hsx never asked for
            return web.Response(body=b"\x0b\x02\x80{}\x03", headers={"Content-Encoding": "br"},
                                content_type="application/json")
        elif mode == "gzipped":  # a fair answer, compressed
            body = json.dumps({"id": "c", "object": "text_completion", "model": MODEL, "choices": [choice]})
            return web.Response(body=gzip.compress(body.encode()), headers={"Content-Encoding": "gzip"},
                                content_type="application/json")
        elif mode == "deep":  # a 200 nested past json's depth (a RecursionError, not a ValueError)
            return web.Response(body=b"[" * 200_000, content_type="application/json")
        return web.json_response({"id": "c", "object": "text_completion", "model": MODEL, "choices": [choice]})

    async def chat(self, request: web.Request) -> web.Response:
        """A reasoning model's answer as vLLM's reasoning parser gives it: the ids hold <think> and the reasoning, the
        message their parts."""
        self.posts += 1
        body = await request.json()
        text = "".join(f"{m['role']}: {m['content']}\n" for m in body["messages"])
        raw = "<think>\nthe user greets\n</think>\n\nhello there"
        return web.json_response({"id": "c", "object": "chat.completion", "model": MODEL,
                                  "prompt_token_ids": self.ids(text),
                                  "choices": [{"index": 0, "finish_reason": "stop", "token_ids": self.ids(raw) + [2],
                                               "message": {"role": "assistant", "content": "hello there",
                                                           "reasoning_content": "the user greets"}}]})


@pytest.fixture
def servers(tok):
    """(the hostile server, the server its redirect points at)."""
    other = Server(tok)
    hostile = Server(tok, redirect_to=other.url)
    yield hostile, other
    hostile.close()
    other.close()


def corpus(tmp_path, mode: str, name: str = "prompts.jsonl") -> str:
    """Four fair records around a hostile one (line 3), and a chat."""
    path = tmp_path / name
    lines = [{"id": f"r{i}", "prompt": f"record {i}: once upon a time"} for i in range(5)]
    lines[2]["prompt"] = f"record 2: mode={mode} please"
    lines.append({"id": "chat", "messages": [{"role": "user", "content": "hi"}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def config(server, corpus_path, out, tokenizer_dir, **kw) -> RegenerateConfig:
    return RegenerateConfig(server=(server.url,), corpus=(corpus_path,), output=str(out), max_tokens=MAX_TOKENS,
                            concurrency=2, progress=False, request_timeout_s=20, retries=1, tokenizer=tokenizer_dir,
                            **kw)


def rows(out) -> dict[str, dict]:
    table = read_manifest(str(out))
    return {r["sample_id"]: r for r in table.to_pylist()}


def assert_only_the_hostile_record_failed(out, result, *words) -> str:
    assert (result.ok, result.failed, result.records, result.stopped) == (5, 1, 6, None), result.lines()
    settled = rows(out)
    assert {sid: r["status"] for sid, r in settled.items()} == {
        "r0": OK, "r1": OK, "r2": FAILED, "r3": OK, "r4": OK, "chat": OK}
    error = settled["r2"]["error"]
    assert "\n" not in error and "prompts.jsonl:3" in error, error  # one line naming the record
    for word in words:
        assert word in error, error
    return error


@pytest.mark.parametrize("mode,words", [
    ("oversized", ["answered 200 with more than", "--max-answer-bytes"]),
    ("more_ids", ["200000 token ids for --max-tokens 48"]),
    ("mismatch", ["do not decode to its text", "'hello'"]),
    ("gzipbomb", ["answered 200 with more than", "--max-answer-bytes"]),
    ("br", ["Content-Encoding 'br'", "serve it uncompressed"]),
])
def test_a_hostile_answer_fails_its_record_alone(servers, tokenizer_dir, tmp_path, mode, words):
    hostile, _ = servers
    out = tmp_path / "regen"
    result = regenerate(config(hostile, corpus(tmp_path, mode), out, tokenizer_dir))
    assert_only_the_hostile_record_failed(out, result, hostile.url, *words)
    kept = {r.sample_id: json.loads(r.payload) for block in read_records(CorpusFile(str(out), "regenerated"))
            for r in block}
    assert sorted(kept) == ["chat", "r0", "r1", "r3", "r4"]
    assert kept["chat"]["messages"][-1] == {"role": "assistant", "content": "hello there",
                                            "reasoning_content": "the user greets"}


def test_a_compressed_answer_is_read_like_a_plain_one(servers, tokenizer_dir, tmp_path):
    hostile, _ = servers
    out = tmp_path / "regen"
    result = regenerate(config(hostile, corpus(tmp_path, "gzipped"), out, tokenizer_dir))
    assert (result.ok, result.failed) == (6, 0), result.lines()


def test_an_endless_answer_is_cut_at_the_cap_and_the_driver_memory_stays_bounded(servers, tokenizer_dir, tmp_path):
    hostile, _ = servers
    process = psutil.Process()
    base = peak = process.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = tmp_path / "regen"
        result = regenerate(config(hostile, corpus(tmp_path, "endless"), out, tokenizer_dir))
    finally:
        done.set()
        sampler.join()
    grew = (peak - base) / 2**20
    assert grew < 200, f"the driver's memory grew by {grew:.0f} MiB on an endless answer"
    cap = (8 << 20) + 1024 * MAX_TOKENS  # the documented default: 8 MiB + 1 KiB per token asked for
    assert_only_the_hostile_record_failed(out, result, hostile.url, f"with more than {cap} bytes", "--max-answer-bytes")


def test_a_redirect_to_another_server_fails_its_record_and_is_not_followed(servers, tokenizer_dir, tmp_path):
    hostile, other = servers
    out = tmp_path / "regen"
    result = regenerate(config(hostile, corpus(tmp_path, "redirect"), out, tokenizer_dir))
    assert other.posts == 0  # no prompt went to the server never checked with /v1/models
    assert_only_the_hostile_record_failed(out, result, hostile.url, "307, a redirect to", other.url, "--server")
    assert set(result.per_server) == {hostile.url + "/v1"}


def test_an_output_inside_a_model_or_a_run_is_refused_before_any_work(servers, tmp_path, capsys):
    hostile, _ = servers
    prompts = corpus(tmp_path, "none")
    model, run = tmp_path / "model", tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    model.mkdir()
    (model / "config.json").write_text("{}")  # config.json beside weights: what makes a folder a model's
    (model / "model.safetensors").write_bytes(b"")
    for output, message in ((str(model / "regen"), "which holds a model"),
                            (str(run / "data" / "regen"), "which holds an extraction run"),
                            (str(tmp_path), "contains the --corpus file")):
        with pytest.raises(SystemExit) as e:
            main(["regenerate", "--server", hostile.url, "--corpus", prompts, "--output", output, "--no-progress"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "pick another --output" in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert hostile.posts == 0 and not (run / "data" / "regen").exists() and not (model / "regen").exists()


def test_a_resume_with_another_corpus_or_settings_exits_2_naming_the_difference(servers, tokenizer_dir, tmp_path,
                                                                                capsys):
    hostile, _ = servers
    out = tmp_path / "regen"
    first = corpus(tmp_path, "none")
    argv = ["regenerate", "--server", hostile.url, "--output", str(out), "--max-tokens", str(MAX_TOKENS),
            "--no-progress", "--tokenizer", tokenizer_dir]
    assert main([*argv, "--corpus", first]) == 0
    capsys.readouterr()
    posts = hostile.posts
    other = corpus(tmp_path, "none", name="other.jsonl")
    for extra, words in ((["--corpus", other], ["corpus: 1 file(s) not in it now given", "other.jsonl",
                                                 "corpus: 1 of its file(s) not given now", "prompts.jsonl"]),
                         (["--corpus", first, "--temperature", "0.5"], ["temperature 0.0 there, 0.5 now"])):
        with pytest.raises(SystemExit) as e:
            main([*argv, *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and all(w in err for w in words) and "write to another --output" in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert hostile.posts == posts  # nothing asked of the server
    assert sorted(rows(out)) == ["chat", "r0", "r1", "r2", "r3", "r4"]  # nothing added


def _committed_corpus(folder, records: list[dict]) -> RunDir:
    run = RunDir(str(folder))
    run.put(REGEN_JSON, b'{"format": "hsx.regenerated", "version": "1", "settings": {}}')
    writer = PartWriter(run, "20261204T000000.000000Z-test0001")
    for i, record in enumerate(records):
        writer.add(Outcome(f"s{i}", f"c.jsonl:{i + 1}", record=record, tokens=1, exact=True))
    writer.flush()
    return run


def test_a_regenerated_record_over_the_record_limit_fails_alone(tmp_path):
    folder = tmp_path / "regen"
    _committed_corpus(folder, [{"prompt": "short"}, {"prompt": "x" * 5000}, {"prompt": "short too"}])
    got = [r for block in read_records(CorpusFile(str(folder), "regenerated"), max_record_bytes=4096)
           for r in block]
    assert [r.sample_id for r in got] == ["s0", "s1", "s2"]
    assert got[0].error is None and got[2].error is None and got[1].payload is None
    assert "over the 4096-byte record limit" in got[1].error, got[1].error


def test_the_following_reader_stops_when_the_regeneration_died_before_finishing(tmp_path):
    from connectors.lease import WriterLease

    folder = tmp_path / "regen"
    run = _committed_corpus(folder, [{"prompt": "one"}, {"prompt": "two"}])
    lease = WriterLease.acquire(run, "20261204T000000.000000Z-test0001", command="hsx regenerate")
    got: list = []

    def follow() -> None:
        got.extend(r for block in read_records(CorpusFile(str(folder), "regenerated-follow")) for r in block)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    time.sleep(1.2)  # a poll or more
    assert reader.is_alive()  # the writer lives: the reader waits for more
    lease.release()  # the regeneration died: no finished.json, and its lease is gone
    reader.join(10)
    assert not reader.is_alive(), "the following reader still polls a regeneration that is gone"
    assert not (folder / FINISHED).exists()
    assert [r.error for r in got[:2]] == [None, None]
    assert len(got) == 3 and got[2].error is not None
    assert str(folder) in got[2].error and "stopped before it finished" in got[2].error
    assert "Re-run the same command" in got[2].error


def test_token_ids_match_their_text_up_to_what_servers_legitimately_change(tok):
    """regeneration.answers.text_problem on the trained tokenizer's real ids: what a server's text legitimately differs by
    passes (a leading space, the end-of-turn token, a stop string cut from the text, a character cut between tokens,
    a reasoning parser's tags, a tool parser's call); anything more fails."""
    from regeneration.answers import MARKUP_CHARS, ids_problem, text_problem

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    def check(token_ids, text, finish="length", **kw):
        return text_problem(tok, token_ids, text, finish_reason=finish, chat=kw.pop("chat", False), **kw)

    fox = ids(" the quick fox")
    assert check(fox, "the quick fox") is None  # the text without the leading space
    assert check(ids("the quick fox"), " the quick fox") is None  # a SentencePiece decode drops the leading space
    assert check(fox + [tok.eos_token_id], " the quick fox", finish="stop") is None  # the end of turn: special
    assert check(ids(" the quick fox END"), " the quick fox", finish="stop", stop=("END",)) is None  # cut at "END"
    cut = ids("the fox ü")[:-1]  # the last character's second byte never came
    assert tok.decode(cut).endswith("\ufffd") and check(cut, "the fox ") is None
    think = ids("<think>\nthe user greets\n</think>\n\nhello there") + [2]
    assert check(think, "hello there", finish="stop", chat=True, reasoning="the user greets") is None
    call = ids('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "country": "France", '
               '"units": "metric"}}\n</tool_call>')
    assert check(call, "", finish="tool_calls", chat=True, tool_calls=[{"function": {"name": "get_weather"}}]) is None

    assert "do not decode to its text" in check(ids(" the quick fox and then some more"), "the quick fox")
    assert check(ids(" the quick fox END and on"), " the quick fox", finish="stop", stop=("END",)) is not None
    assert check(ids(" the quick fox END"), " the quick fox", finish="length", stop=("END",)) is not None
    assert check(fox, "the quick dog") is not None
    assert check(think, "goodbye", finish="stop", chat=True, reasoning="the user greets") is not None
    assert "text and reasoning" in check(think, "hello there", chat=True, reasoning="the user waves")
    junk = ids(" the quick fox" + " and a red river" * (MARKUP_CHARS // 10))
    assert check(junk, "the quick fox", chat=True) is not None  # more than markup beyond the content
    assert check(call, "", chat=True, tool_calls=[{"function": {"name": "send_mail"}}]) is not None
    assert check(call, "", chat=True) is not None  # the call's text, but no call parsed out of it
    assert "outside the tokenizer's vocabulary" in ids_problem([5, len(tok)], 8, tok)
    assert "more than asked for" in ids_problem(fox, len(fox) - 1, None) and ids_problem(fox, len(fox), tok) is None


def test_an_answer_nested_past_the_json_parser_depth_sets_the_server_aside_without_a_crash(servers, tokenizer_dir,
                                                                                         tmp_path):
    # second hostile pass: 200 with 200,000 nested "[" (json.loads raises RecursionError, which no handler caught)
    hostile, _ = servers
    out = tmp_path / "regen"
    result = regenerate(config(hostile, corpus(tmp_path, "deep"), out, tokenizer_dir))
    said = "\n".join(result.lines())
    assert result.failed >= 1 and "what is not an OpenAI completion (maximum recursion depth" in said, said
    assert "Traceback" not in said and "RecursionError" not in said
