"""`hsx regenerate` against a live `hsx serve` (the real CLI, its own Ray): greedy answers regenerated through the
server and extracted prefill-only equal the one-engine regeneration (`hsx run --max-tokens N --include-output-tokens`)
token for token and state for state; chats are regenerated turn by turn (against transformers' `generate` run on the
turns one by one); the server's 4xx answers become failed rows with its message; a server answering what is not an
OpenAI API is refused; a re-run skips what is committed and the counts add up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from connectors import load_hidden_states
from connectors.run import FAILED, OK, committed_rows, ok_rows, read_manifest
from jobs.corpus import expand_corpus, read_records
from jobs.regenerate import RegenerateConfig, prepare_regeneration, regenerate
from tests.serve.conftest import API_KEY, LAYERS

MAX_TOKENS = 6


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def regen_config(server, corpus, out, **kw) -> RegenerateConfig:
    return RegenerateConfig(server=(server.url,), corpus=(corpus,), output=str(out), api_key=API_KEY,
                            max_tokens=MAX_TOKENS, concurrency=4, progress=False, **kw)


def committed(out) -> dict[str, dict]:
    """sample id -> regenerated record, read as hsx run reads the corpus."""
    (file,) = expand_corpus([str(out)])
    assert file.format == "regenerated"
    return {r.sample_id: json.loads(r.payload) for block in read_records(file) for r in block if r.error is None}


def run_hsx(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *argv], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HSX_REGENERATE_API_KEY": API_KEY})


def test_greedy_regeneration_through_hsx_serve_extracts_as_the_one_engine_regeneration(server, serve_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(serve_model)
    prompts = ["The quick brown fox", "def main():\n    return", "Once upon a time there was", "import os\nimport"]
    corpus = write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(prompts)])
    out = tmp_path / "regenerated"
    result = regenerate(regen_config(server, corpus, out))
    assert (result.ok, result.failed, result.skipped, result.records) == (4, 0, 0, 4)
    assert result.exact == 4 and not result.text_only
    records = committed(out)
    for i, p in enumerate(prompts):
        r = records[f"p{i}"]
        prompt_ids = tok(p).input_ids
        assert r["input_ids"][:len(prompt_ids)] == prompt_ids and r["prompt"] == p
        assert 0 < len(r["input_ids"]) - len(prompt_ids) <= MAX_TOKENS

    # prefill-only over the regenerated corpus vs the engine's own regeneration of the same prompts
    common = ["--model", serve_model, "--layers", ",".join(map(str, LAYERS)), "--no-progress", "--no-compact"]
    a = run_hsx("run", "--corpus", str(out), "--output", str(tmp_path / "run-a"), *common)
    assert a.returncode == 0, a.stderr[-3000:]
    b = run_hsx("run", "--corpus", corpus, "--output", str(tmp_path / "run-b"), "--max-tokens", str(MAX_TOKENS),
                "--include-output-tokens", *common)
    assert b.returncode == 0, b.stderr[-3000:]
    rows_a, rows_b = ok_rows(str(tmp_path / "run-a")), ok_rows(str(tmp_path / "run-b"))
    assert rows_a["sample_id"].to_pylist() == rows_b["sample_id"].to_pylist() == [f"p{i}" for i in range(4)]
    for pa_, pb_ in zip(rows_a["path"].to_pylist(), rows_b["path"].to_pylist()):
        fa = load_hidden_states(str(tmp_path / "run-a" / pa_))
        fb = load_hidden_states(str(tmp_path / "run-b" / pb_))
        n = len(fb["token_ids"])  # the engine stores no state for its last generated token (never fed back)
        assert fa["token_ids"][:n].tolist() == fb["token_ids"].tolist() and len(fa["token_ids"]) == n + 1
        torch.testing.assert_close(fa["hidden_states"][:n], fb["hidden_states"], rtol=1e-4, atol=1e-4)

    # a re-run has nothing left: every record skipped, nothing asked of the server
    again = regenerate(regen_config(server, corpus, out))
    assert (again.ok, again.failed, again.skipped, again.requests) == (0, 0, 4, 0)

    # both in one command: hsx run --regenerate-with follows the regeneration as it commits
    c = run_hsx("run", "--corpus", corpus, "--output", str(tmp_path / "run-c"), "--regenerate-with", server.url,
                "--regenerate", json.dumps({"max_tokens": MAX_TOKENS, "concurrency": 2, "flush_rows": 1}), *common)
    assert c.returncode == 0, c.stderr[-3000:]
    assert "hsx regenerate finished" in c.stdout and "4 ok, 0 failed" in c.stdout, c.stdout
    rows_c = ok_rows(str(tmp_path / "run-c"))
    assert rows_c["sample_id"].to_pylist() == rows_a["sample_id"].to_pylist()
    for pa_, pc_ in zip(rows_a["path"].to_pylist(), rows_c["path"].to_pylist()):
        fa = load_hidden_states(str(tmp_path / "run-a" / pa_))
        fc = load_hidden_states(str(tmp_path / "run-c" / pc_))
        assert fa["token_ids"].tolist() == fc["token_ids"].tolist()
        torch.testing.assert_close(fa["hidden_states"], fc["hidden_states"], rtol=1e-4, atol=1e-4)
    assert set(committed(tmp_path / "run-c" / "regenerated")) == {f"p{i}" for i in range(4)}


def test_chats_regenerate_every_assistant_turn_in_order_as_the_turns_one_by_one(server, serve_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(serve_model)
    model = AutoModelForCausalLM.from_pretrained(serve_model).eval()
    chats = [
        {"id": "two-turns", "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "an old answer"}, {"role": "user", "content": "and then?"},
            {"role": "assistant", "content": "another old answer"}]},
        {"id": "sharegpt", "conversations": [{"from": "human", "value": "say something"}]},  # no answer: one added
    ]
    corpus = write_jsonl(tmp_path / "chats.jsonl", chats)
    out = tmp_path / "regenerated"
    result = regenerate(regen_config(server, corpus, out))
    assert (result.ok, result.failed) == (2, 0), result.lines()
    records = committed(out)

    def oracle(messages):  # the turns one by one: each answer from the conversation so far, greedy
        messages = [dict(m) for m in messages]
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            ids = tok.apply_chat_template(messages[:i], add_generation_prompt=True, return_dict=True)["input_ids"]
            with torch.no_grad():
                gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
            m["ids"], m["content"] = gen, tok.decode(gen, skip_special_tokens=True)
        return messages

    two = records["two-turns"]
    expected = oracle(chats[0]["messages"])
    assert [m["role"] for m in two["messages"]] == [m["role"] for m in expected]
    assert [m["content"] for m in two["messages"]] == [m["content"] for m in expected]
    assert two["messages"][0] == {"role": "system", "content": "be brief"}
    answers = [m["ids"] for m in expected if m["role"] == "assistant"]
    first_round_trips = tok(tok.decode(answers[0], skip_special_tokens=True), add_special_tokens=False).input_ids \
        == answers[0]
    if first_round_trips:  # the last request's prompt holds the first answer as generated: the servers' own ids
        ids, mask = two["input_ids"], two["loss_mask"]
        rendered = tok.apply_chat_template(two["messages"][:3], add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
        assert ids[:len(rendered)] == rendered
        assert [t for t, k in zip(ids, mask) if k] == [t for a in answers for t in a]
    else:  # a random model's answer that its text does not re-tokenize to: the record keeps its text, said once
        assert "input_ids" not in two
        assert result.text_only == {"the chat template renders an earlier turn's generated ids differently": 1}
    shared = records["sharegpt"]  # one turn: always the servers' own ids
    (answer,) = [m for m in oracle([{"role": "user", "content": "say something"},
                                    {"role": "assistant", "content": ""}]) if m["role"] == "assistant"]
    assert [m["role"] for m in shared["messages"]] == ["user", "assistant"]
    assert shared["messages"][1]["content"] == answer["content"]
    prompt = tok.apply_chat_template(shared["messages"][:1], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert shared["input_ids"] == prompt + answer["ids"]
    assert shared["loss_mask"] == [0] * len(prompt) + [1] * len(answer["ids"])
    assert result.exact == 2 - (not first_round_trips)


def test_refusals_become_failed_rows_with_the_servers_message_and_the_rest_is_kept(server, tmp_path):
    long_prompt = " ".join(["word"] * 200)  # over the server's --max-prompt-tokens 64: 400 for this record only
    corpus = write_jsonl(tmp_path / "mixed.jsonl", [
        {"id": "fine", "prompt": "a short prompt"}, {"id": "too-long", "prompt": long_prompt},
        {"id": "no-field", "text": "not a record hsx knows"}, {"id": "bad-ids", "input_ids": [1, -2]}])
    with open(corpus, "a") as f:
        f.write("{broken json\n")
    out = tmp_path / "regenerated"
    result = regenerate(regen_config(server, corpus, out))
    assert (result.ok, result.failed, result.skipped, result.records) == (1, 4, 0, 5)
    table = read_manifest(str(out))
    rows = {r["sample_id"]: r for r in table.to_pylist()}
    assert rows["fine"]["status"] == OK
    too_long = rows["too-long"]
    assert too_long["status"] == FAILED and "answered 400" in too_long["error"] and too_long["retry"] is False
    assert "64" in too_long["error"]  # the server's own message names its limit
    assert "none of the fields" in rows["no-field"]["error"] and "input_ids[1]" in rows["bad-ids"]["error"]
    assert all(r["retry"] is False for r in table.to_pylist() if r["status"] == FAILED)
    assert len(committed_rows(table)) == 1 and set(committed(out)) == {"fine"}
    # the counts add up in hsx status, and a re-run retries nothing that fails the same way every time
    status = run_hsx("status", str(out))
    assert status.returncode == 0 and "1 ok, 4 failed (5 tried)" in status.stdout, status.stdout + status.stderr
    again = regenerate(regen_config(server, corpus, out))
    assert (again.ok, again.failed, again.skipped, again.requests) == (0, 0, 5, 0)


def test_a_server_that_is_not_an_openai_api_is_refused_before_any_work(tmp_path, server):
    import http.server
    import threading

    class Garbage(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b"<html>not an API</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        corpus = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "x"}])
        garbage = f"http://127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(ValueError, match=r"did not answer an OpenAI model list .*body starts b'<html>"):
            prepare_regeneration(RegenerateConfig(server=(garbage,), corpus=(corpus,), output=str(tmp_path / "o"),
                                                  progress=False))
        with pytest.raises(ValueError, match=r"refuses the API key \(401"):
            prepare_regeneration(RegenerateConfig(server=(server.url,), corpus=(corpus,), api_key="wrong",
                                                  output=str(tmp_path / "o"), progress=False))
        with pytest.raises(ValueError, match=r"does not serve model 'other'"):
            prepare_regeneration(regen_config(server, corpus, tmp_path / "o", model="other"))
        cli = run_hsx("regenerate", "--server", garbage, "--corpus", corpus, "--output", str(tmp_path / "o"))
        assert cli.returncode == 2 and "Traceback" not in cli.stderr and "OpenAI model list" in cli.stderr
    finally:
        httpd.shutdown()
    assert not os.path.exists(tmp_path / "o" / "data")
