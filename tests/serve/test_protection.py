"""Every bad input and protection case of `hsx serve`, each with its status code and its OpenAI-style error object:
the API key, malformed JSON and wrong types, size and length limits, custom paths outside the allowed roots, the
bounded queue, unsupported settings, and a client that goes away (its request aborted, no file left)."""

from __future__ import annotations

import glob
import os
import time

import openai
import pytest
import requests

from connectors import load_hidden_states

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def error_of(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def files(root: str) -> set[str]:
    return set(glob.glob(os.path.join(root, "**", "*"), recursive=True))


def completion(server, **fields) -> dict:
    return {"model": server.model, "prompt": [5, 6, 7], "max_tokens": 0, **fields}


def ask_until(server, done, timeout_s: float = 60) -> None:
    """A replica reports aborts and removed files with its next answers: send requests until `done()` (or time out;
    the caller's assertion then says what did not happen)."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        assert server.post("/v1/completions", completion(server)).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_requests_without_the_api_key_get_401(server, path):
    for key in (None, "wrong-key"):
        err = error_of(server.post(path, completion(server), key=key), 401)
        assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
    r = server.post(path, completion(server), headers={"Authorization": "Basic " + "x"}, key=None)
    assert r.status_code == 401


def test_models_and_metrics_need_the_key_but_health_does_not(server):
    for path in ("/v1/models", "/metrics"):
        assert error_of(server.get(path, key=None), 401)["type"] == "authentication_error"
        assert server.get(path).status_code == 200
    assert server.get("/health", key=None).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="nope").models.list()


def test_malformed_json_gets_400(server):
    err = error_of(server.post("/v1/completions", b'{"model": "m", "prompt": [1, 2'), 400)
    assert err["code"] == "invalid_json" and "not valid JSON" in err["message"]
    err = error_of(server.post("/v1/completions", b"[1, 2, 3]"), 400)
    assert "JSON object" in err["message"]


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"prompt": [1, "two", 3]}, "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"kv_transfer_params": {"include_output_tokens": "yes"}}, "kv_transfer_params.include_output_tokens"),
    ({"kv_transfer_params": {"hidden_state_path": "x.safetensors"}}, "kv_transfer_params.hidden_state_path"),
    ({"return_token_ids": 1}, "return_token_ids"),
    ({"seed": 1 << 64}, "seed"),  # past torch's generator: it failed the whole engine batch, every request a 500
    ({"seed": -(1 << 63) - 1}, "seed"),
])
def test_wrong_types_get_400_naming_the_field(server, fields, param):
    err = error_of(server.post("/v1/completions", completion(server, **fields)), 400)
    assert err["param"] == param and param in err["message"], err


def test_an_infinite_temperature_gets_400(server):
    body = b'{"model": "%s", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 1e400}' % server.model.encode()
    err = error_of(server.post("/v1/completions", body), 400)  # 1e400 parses as infinity
    assert err["param"] == "temperature", err


def test_a_seed_at_the_edge_of_the_range_is_served(server):
    for seed in ((1 << 64) - 1, -(1 << 63)):
        r = server.post("/v1/completions", completion(server, max_tokens=2, temperature=1.0, seed=seed))
        assert r.status_code == 200, r.text


def test_chat_template_kwargs_that_change_what_the_template_returns_get_400(server):
    for key, value in (("return_tensors", "np"), ("truncation", True), ("max_length", 2)):
        r = server.post("/v1/chat/completions", {"model": server.model, "max_tokens": 0,
                                                 "messages": [{"role": "user", "content": "hello"}],
                                                 "chat_template_kwargs": {key: value}})
        err = error_of(r, 400)
        assert err["param"] == "chat_template_kwargs" and key in err["message"], err


def test_missing_fields_get_400_naming_them(server):
    err = error_of(server.post("/v1/completions", {"model": server.model}), 400)
    assert err["param"] == "prompt" and "required" in err["message"].lower()
    err = error_of(server.post("/v1/chat/completions", {"model": server.model, "messages": []}), 400)
    assert err["param"] == "messages"
    err = error_of(server.post("/v1/chat/completions", {"model": server.model, "messages": [{"content": "x"}]}), 400)
    assert err["param"] == "messages[0].role"


@pytest.mark.parametrize("fields, param", [
    ({"stream": True}, "stream"), ({"n": 2}, "n"), ({"logprobs": 2}, "logprobs"),
    ({"echo": True}, "echo"), ({"min_tokens": 4}, "min_tokens"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"skip_special_tokens": False}, "skip_special_tokens"), ({"use_beam_search": True}, "use_beam_search"),
])
def test_settings_hsx_cannot_honour_get_400(server, fields, param):
    err = error_of(server.post("/v1/completions", completion(server, **fields)), 400)
    assert err["param"] == param and err["code"] == "unsupported"


def test_the_no_op_values_of_those_settings_are_accepted(server):
    # what vLLM's clients send when they mean "off": a request carrying them all is served as one without them
    r = server.post("/v1/completions", completion(server, min_tokens=0, min_p=0.0, repetition_penalty=1.0,
                                                  use_beam_search=False, skip_special_tokens=True, n=1, stream=False))
    assert r.status_code == 200, r.text
    assert r.json()["kv_transfer_params"]["hidden_states_path"]


def test_an_unknown_model_gets_404(server):
    err = error_of(server.post("/v1/completions", completion(server, model="gpt-4")), 404)
    assert err["code"] == "model_not_found" and server.model in err["message"]


def test_an_unknown_route_gets_404(server):
    err = error_of(server.get("/v1/embeddings"), 404)
    assert "/v1/completions" in err["message"]


def test_a_body_over_the_limit_gets_400_naming_it(server):
    before = files(server.output)
    big = completion(server, prompt="word " * 20000)  # > --max-body-bytes 65536
    err = error_of(server.post("/v1/completions", big), 400)
    assert err["code"] == "body_too_large" and "65536" in err["message"] and "--max-body-bytes" in err["message"]

    def chunks():  # no Content-Length: the limit holds while the body streams in
        yield b'{"model": "m", "prompt": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}'
    err = error_of(server.post("/v1/completions", chunks()), 400)
    assert err["code"] == "body_too_large"
    assert files(server.output) == before


def _proxy_process(server):
    """Ray Serve's HTTP proxy of this server's own local Ray: the process that receives every request body."""
    import psutil

    for child in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "ProxyActor" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    raise AssertionError("no Ray Serve proxy process under the hsx serve process")


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_huge_body_is_refused_without_the_proxy_holding_it(server, framing):
    """--max-body-bytes bounds memory, not only what the handler accepts: a client streaming 512 MiB gets its 400
    while it sends, and Ray Serve's proxy (which receives the body before the replica reads it) does not grow by
    anything like the body. Measured: 3 MiB with Content-Length, 25 MiB chunked at full loopback speed."""
    import socket
    import threading

    proxy = _proxy_process(server)
    base = peak = proxy.memory_info().rss
    sampling = threading.Event()

    def sample():
        nonlocal peak
        while not sampling.is_set():
            peak = max(peak, proxy.memory_info().rss)
            time.sleep(0.02)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    opening = b'{"model": "m", "prompt": ['
    total, piece = 512 << 20, b"1," * (1 << 19)  # 1 MiB pieces of a never-ending JSON list
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {server.headers()['Authorization']}\r\n"
            "Content-Type: application/json\r\n")
    head += (f"Content-Length: {len(opening) + total}\r\n\r\n" if framing == "content-length" else
             "Transfer-Encoding: chunked\r\n\r\n")
    answer, sent, sent_at_answer = b"", 0, None

    def framed(data: bytes) -> bytes:
        return data if framing == "content-length" else b"%x\r\n%s\r\n" % (len(data), data)

    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head.encode() + framed(opening))
        try:
            while sent < total:
                sock.sendall(framed(piece))
                sent += len(piece)
                sock.setblocking(False)
                try:
                    answer += sock.recv(65536)
                except BlockingIOError:
                    pass
                sock.settimeout(60)  # blocking again, with the timeout (setblocking(True) would drop it)
                if answer and sent_at_answer is None:
                    sent_at_answer = sent
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed the connection after answering: as good as draining it
        sock.settimeout(30)
        while b"\r\n\r\n" not in answer:
            more = sock.recv(65536)
            if not more:
                break
            answer += more
    sampling.set()
    watcher.join()
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"body_too_large" in answer and b"--max-body-bytes" in answer
    assert peak - base < 128 << 20, f"the proxy grew by {(peak - base) >> 20} MiB while {sent >> 20} MiB were sent"
    assert sent_at_answer is not None and sent_at_answer < total // 2, (sent_at_answer, total)  # answered early


def test_a_prompt_over_the_limit_gets_400_naming_it(server):
    before = files(server.output)
    err = error_of(server.post("/v1/completions", completion(server, prompt=list(range(1, 80)))), 400)
    assert err["code"] == "prompt_too_long" and "79 tokens" in err["message"] and "64" in err["message"]
    err = error_of(server.post("/v1/completions", completion(server, prompt="hello " * 100)), 400)
    assert err["code"] == "prompt_too_long" and "has 401 tokens" in err["message"]  # tokenized: 600 characters may fit
    # more characters than 64 tokens of this byte-level tokenizer can hold: refused before tokenizing
    err = error_of(server.post("/v1/completions", completion(server, prompt="hello " * 10000)), 400)
    assert err["code"] == "prompt_too_long" and err["param"] == "prompt"
    assert "at least 4616 tokens (60000 characters, at most 13 per token" in err["message"] and "64" in err["message"]
    assert files(server.output) == before


@pytest.mark.parametrize("prompt, code", [([], "empty_prompt"), ("", "empty_prompt"), ([5, 100000], "invalid_token_ids")])
def test_empty_prompts_and_ids_outside_the_vocabulary_get_400(server, prompt, code):
    err = error_of(server.post("/v1/completions", completion(server, prompt=prompt)), 400)
    assert err["code"] == code


def test_max_tokens_past_max_model_len_gets_400(server):
    err = error_of(server.post("/v1/completions", completion(server, max_tokens=100000)), 400)
    assert err["param"] == "max_tokens" and "max_model_len" in err["message"]


@pytest.mark.parametrize("custom", ["/etc/hsx-escape.safetensors", "../escape.safetensors",
                                    "sub/../../escape.safetensors", "s3://bucket/x.safetensors"])
def test_custom_paths_outside_the_allowed_roots_get_403_and_nothing_is_written(server, custom, tmp_path):
    before = files(os.path.dirname(server.output))
    r = server.post("/v1/completions", completion(server, kv_transfer_params={"hidden_states_path": custom}))
    assert r.status_code in (400, 403)
    err = error_of(r, r.status_code)
    assert err["param"] == "kv_transfer_params.hidden_states_path" and "nothing was written" in err["message"]
    assert files(os.path.dirname(server.output)) == before
    assert not os.path.exists("/etc/hsx-escape.safetensors")


def test_a_refused_custom_path_is_answered_by_the_ingress_before_the_replica_checks_the_prompt(server):
    """The ingress locates a custom path once and answers 403 itself: the request is never queued or tokenized, so
    a request that is also too long for the model gets the 403 (the replica would have answered 400 for the length)."""
    r = server.post("/v1/completions", completion(server, max_tokens=100000,
                                                  kv_transfer_params={"hidden_states_path": "/etc/hsx-escape.st"}))
    err = error_of(r, 403)
    assert err["param"] == "kv_transfer_params.hidden_states_path" and err["code"] == "path_not_allowed"
    assert "nothing was written" in err["message"]


def test_a_custom_path_under_another_allowed_root_is_written(server):
    custom = os.path.join(server.extra_root, "a", "b.safetensors")
    r = server.post("/v1/completions", completion(server, kv_transfer_params={"hidden_states_path": custom}))
    assert r.status_code == 200 and r.json()["kv_transfer_params"]["hidden_states_path"] == custom
    assert os.path.exists(custom)


def test_a_custom_path_another_request_wrote_gets_409_unless_overwrite(server):
    custom = os.path.join(server.output, "twice.safetensors")
    body = completion(server, kv_transfer_params={"hidden_states_path": custom})
    assert server.post("/v1/completions", body).status_code == 200
    err = error_of(server.post("/v1/completions", body), 409)
    assert err["code"] == "path_in_use" and "overwrite" in err["message"]
    body["kv_transfer_params"]["overwrite"] = True
    assert server.post("/v1/completions", body).status_code == 200


def test_a_full_queue_gets_503_with_retry_after_and_keeps_no_file(server):
    before = files(server.output)
    # 60 prompts at once: each of the two replicas takes 16 (two batches of 8), 8 may queue, the rest are refused
    r = server.post("/v1/completions", completion(server, prompt=[[5, 6, 7 + i] for i in range(60)], max_tokens=20,
                                                  ignore_eos=True))
    err = error_of(r, 503)
    assert err["code"] == "queue_full" and "--max-queued-requests" in err["message"]
    assert r.headers["Retry-After"] == "1"
    assert files(server.output) == before  # the prompts that ran had their files removed: all or nothing
    assert server.post("/v1/completions", completion(server)).status_code == 200  # and the server still serves


def test_a_list_request_whose_client_goes_away_keeps_none_of_its_files(server):
    """Its first prompt stops at once and its second decodes on when the client leaves: the finished prompt's file
    goes too (the all-or-nothing rule holds for a request nobody answered). Where the two ran on different replicas,
    the first had answered the ingress, which removes its file; in one engine call, the engine removes it."""
    def first_tokens(prompt, n):
        r = server.post("/v1/completions", completion(server, prompt=prompt, max_tokens=n, temperature=0,
                                                      ignore_eos=True, return_token_ids=True))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    # a token early in the first prompt's greedy output that the second prompt's 1500 greedy tokens never hold
    early = first_tokens([5, 6, 7], 20)
    outputs = {tuple(p): set(first_tokens(p, 1500)) for p in ([8, 9, 10], [11, 12], [13, 14, 15, 16], [17, 3])}
    stop, slow = next((t, list(p)) for t in early for p, out in outputs.items() if t not in out)
    aborted = "hsx_serve_requests_aborted_total"
    before = server.metrics().get(aborted, 0)
    pattern = os.path.join(server.output, "**", "cmpl-*-[01].safetensors")  # a list request's files
    listed = set(glob.glob(pattern, recursive=True))  # other tests' list requests, answered
    body = completion(server, prompt=[[5, 6, 7], slow], max_tokens=1500, temperature=0, ignore_eos=True,
                      stop_token_ids=[stop])
    with pytest.raises(requests.Timeout):
        server.post("/v1/completions", body, timeout=1.0)
    ask_until(server, lambda: server.metrics().get(aborted, 0) != before)
    assert server.metrics().get(aborted, 0) >= before + 1  # the decoding prompt: aborted, nothing written
    assert set(glob.glob(pattern, recursive=True)) == listed  # and the finished one's file removed


def test_a_client_that_goes_away_leaves_no_file(server):
    gone = os.path.join(server.output, "gone", "left.safetensors")
    body = completion(server, max_tokens=1500, ignore_eos=True, temperature=0,
                      kv_transfer_params={"hidden_states_path": gone})
    keys = ('hsx_serve_files_discarded_total{reason="client_gone"}', "hsx_serve_requests_aborted_total")
    before = sum(server.metrics().get(k, 0) for k in keys)
    with pytest.raises(requests.Timeout):
        server.post("/v1/completions", body, timeout=0.5)
    # the request is aborted mid-decode (or, had it finished, its file removed); a replica reports that with its
    # next answers: ask until the one that ran it has answered
    ask_until(server, lambda: sum(server.metrics().get(k, 0) for k in keys) != before)
    assert sum(server.metrics().get(k, 0) for k in keys) == before + 1
    assert server.metrics().get("hsx_serve_requests_aborted_total", 0) >= 1  # 1500 tokens: it was still running
    assert not os.path.exists(gone) and not os.path.exists(gone + ".lock")
    # and the path is free again: a retry writes it (the connector forgot the aborted or removed request)
    retry = server.post("/v1/completions", completion(server, prompt=[5, 6, 7], max_tokens=1,
                                                      kv_transfer_params={"hidden_states_path": gone}))
    assert retry.status_code == 200, retry.text
    assert load_hidden_states(gone)["token_ids"].tolist()[:3] == [5, 6, 7]
    assert server.metrics()['hsx_serve_requests_total{endpoint="completions",status="499"}'] >= 1


def test_a_request_chat_template_gets_400_naming_the_flag(server):
    """The server was not started with --trust-request-chat-template: a client's Jinja program is not run (the
    bounds it would run under are tested in test_templates.py)."""
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"chat_template": "{% for a in range(99999) %}{% endfor %}"})
    err = e.value.body
    assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"], err
    reply = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=1)  # the model's own template still serves
    assert reply.choices[0].message is not None


def test_a_custom_path_over_another_requests_default_named_file_gets_409(server):
    first = server.post("/v1/completions", completion(server))
    assert first.status_code == 200
    theirs = first.json()["kv_transfer_params"]["hidden_states_path"]
    before = open(theirs, "rb").read()
    for custom in (theirs, os.path.relpath(theirs, server.output)):  # absolute, or relative to --output
        err = error_of(server.post("/v1/completions", completion(
            server, prompt=[9, 9, 9], kv_transfer_params={"hidden_states_path": custom})), 409)
        assert err["code"] == "path_in_use" and "exists already" in err["message"] and "overwrite" in err["message"]
    assert open(theirs, "rb").read() == before  # the other client's file is as it answered it


@pytest.mark.parametrize("shape", ["existing folder", "file on the way", "symlink on the way"])
def test_a_custom_path_that_cannot_be_written_is_refused_before_any_work(server, shape):
    base = os.path.join(server.output, f"unwritable-{shape.replace(' ', '-')}")
    os.makedirs(os.path.join(base, "real"), exist_ok=True)
    if shape == "existing folder":
        os.makedirs(os.path.join(base, "taken.safetensors"), exist_ok=True)
        custom = os.path.join(base, "taken.safetensors")
    elif shape == "file on the way":
        with open(os.path.join(base, "afile"), "w") as f:
            f.write("x")
        custom = os.path.join(base, "afile", "x.safetensors")
    else:  # points inside the root, but a link can be re-pointed between the check and the write
        if not os.path.islink(os.path.join(base, "link")):
            os.symlink(os.path.join(base, "real"), os.path.join(base, "link"))
        custom = os.path.join(base, "link", "x.safetensors")
    before = files(base)
    started = time.monotonic()
    r = server.post("/v1/completions", completion(server, max_tokens=200, ignore_eos=True,
                                                  kv_transfer_params={"hidden_states_path": custom}))
    err = error_of(r, 403)
    assert err["param"] == "kv_transfer_params.hidden_states_path" and "nothing was written" in err["message"]
    assert {"existing folder": "existing folder", "file on the way": "is a file, not a folder",
            "symlink on the way": "goes through the symlink"}[shape] in err["message"], err
    assert files(base) == before
    assert time.monotonic() - started < 60


def test_an_image_part_on_a_text_only_target_gets_400_naming_it(server):
    # hostile input: an image_url part beside a text part (issue 49 item 8: the one rule of LLM.chat and corpora)
    body = {"model": server.model, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in it?"}, {"type": "image_url", "image_url": {"url": "file:///x.png"}}]}]}
    err = error_of(server.post("/v1/chat/completions", body), 400)
    assert "content part 1 is of type 'image_url'" in err["message"] and "text-only model" in err["message"]
