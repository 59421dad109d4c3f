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

import torch

from connectors import load_hidden_states
from connectors.manifest import ok_rows
from corpus.readers import expand_corpus, read_records
from harness.serving import API_KEY, LAYERS
from regeneration.config import RegenerateConfig
from regeneration.regenerate import regenerate

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

    # the engine's own regeneration of the same prompts, the oracle of what follows
    common = ["--model", serve_model, "--layers", ",".join(map(str, LAYERS)), "--no-progress", "--no-compact"]
    b = run_hsx("run", "--corpus", corpus, "--output", str(tmp_path / "run-b"), "--max-tokens", str(MAX_TOKENS),
                "--include-output-tokens", *common)
    assert b.returncode == 0, b.stderr[-3000:]
    rows_b = ok_rows(str(tmp_path / "run-b"))
    assert rows_b["sample_id"].to_pylist() == [f"p{i}" for i in range(4)]

    # a re-run has nothing left: every record skipped, nothing asked of the server
    again = regenerate(regen_config(server, corpus, out))
    assert (again.ok, again.failed, again.skipped, again.requests) == (0, 0, 4, 0)

    # regenerated through the server and extracted prefill-only, in one command (hsx run --regenerate-with follows
    # the regeneration as it commits): the engine's tokens and states, plus the last generated token's
    c = run_hsx("run", "--corpus", corpus, "--output", str(tmp_path / "run-c"), "--regenerate-with", server.url,
                "--regenerate", json.dumps({"max_tokens": MAX_TOKENS, "concurrency": 2, "flush_rows": 1}), *common)
    assert c.returncode == 0, c.stderr[-3000:]
    assert "hsx regenerate finished" in c.stdout and "4 ok, 0 failed" in c.stdout, c.stdout
    rows_c = ok_rows(str(tmp_path / "run-c"))
    assert rows_c["sample_id"].to_pylist() == rows_b["sample_id"].to_pylist()
    for pb_, pc_ in zip(rows_b["path"].to_pylist(), rows_c["path"].to_pylist()):
        fb = load_hidden_states(str(tmp_path / "run-b" / pb_))
        fc = load_hidden_states(str(tmp_path / "run-c" / pc_))
        n = len(fb["token_ids"])  # the engine stores no state for its last generated token (never fed back)
        assert fc["token_ids"][:n].tolist() == fb["token_ids"].tolist() and len(fc["token_ids"]) == n + 1
        torch.testing.assert_close(fc["hidden_states"][:n], fb["hidden_states"], rtol=1e-4, atol=1e-4)
    # the same answers as the separate regeneration above (hsx run reads such a folder by --corpus too: the
    # benchmarks' bench_regenerate_drafters.py extracts one)
    assert committed(tmp_path / "run-c" / "regenerated") == records


def test_a_server_without_token_ids_keeps_the_text_and_says_so_once(server, tmp_path, caplog):
    """SGLang's OpenAI server answers without token ids: here hsx serve behind a relay that drops them."""
    import http.server
    import threading

    import requests

    class DropIds(http.server.BaseHTTPRequestHandler):
        def _relay(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            r = requests.request(method, server.url + self.path, data=body or None, timeout=60,
                                 headers={k: v for k, v in self.headers.items() if k.lower() in (
                                     "authorization", "content-type")})
            doc = r.json()
            doc.pop("prompt_token_ids", None)
            for choice in doc.get("choices", []) if isinstance(doc, dict) else []:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
            raw = json.dumps(doc).encode()
            self.send_response(r.status_code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):  # noqa: N802
            self._relay("GET")

        def do_POST(self):  # noqa: N802
            self._relay("POST")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), DropIds)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    corpus = write_jsonl(tmp_path / "c.jsonl", [
        {"id": "a", "prompt": "The quick brown fox"}, {"id": "b", "prompt": "Once upon a time"},
        {"id": "c", "messages": [{"role": "user", "content": "hello"}]},
        {"id": "d", "input_ids": [5, 6, 7]}])  # token ids in, token ids needed out: fails, retried by a re-run
    out = tmp_path / "regenerated"
    relay = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with caplog.at_level("WARNING", logger="regeneration.regenerate"):
            result = regenerate(RegenerateConfig(server=(relay,), corpus=(corpus,), output=str(out), api_key=API_KEY,
                                                 max_tokens=MAX_TOKENS, concurrency=2, progress=False))
    finally:
        httpd.shutdown()
    assert (result.ok, result.failed, result.exact) == (3, 1, 0)
    assert result.text_only == {"the server returned no token ids": 3}
    assert sum("keep their text only" in r.message for r in caplog.records) == 1  # said once
    records = committed(out)
    for sid, prompt in (("a", "The quick brown fox"), ("b", "Once upon a time")):
        assert "input_ids" not in records[sid] and records[sid]["prompt"] == prompt + records[sid]["completion"]
    assert "input_ids" not in records["c"] and records["c"]["messages"][-1]["role"] == "assistant"
    (failure,) = result.failures
    assert failure[0] == "d" and "return_token_ids" in failure[1]
    assert any("text only (3)" in line for line in result.lines())
