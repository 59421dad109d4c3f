"""`hsx eval-drafter --engine vllm`: the evaluation decodes every method in real vLLM (a P-EAGLE head as vLLM serves
it: eagle3 + parallel_drafting), reads vLLM's own counters, and checks each method's greedy tokens against plain
vLLM decoding (which tests/vllm_engine/test_drafters_in_vllm.py checks against transformers' greedy generate). Needs vLLM; skipped
without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: these tests run in the venv docs/engines.md builds")

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

from tests.vllm_engine.test_drafters_in_vllm import (  # noqa: E402,F401 - the fixtures, shared
    PROMPTS,
    _trained_head,
    greedy_run,
    oracle,
    target,
)


def test_eval_drafter_in_vllm_decodes_each_method_losslessly_with_vllms_counters(target, greedy_run,  # noqa: F811
                                                                                 tmp_path):
    """A P-EAGLE head trained 200 steps on the target's greedy continuations: vLLM serves it as eagle3 +
    parallel_drafting, decodes losslessly and accepts its drafts."""
    from vllm_engine.speculative import vllm_speculative_config

    assert vllm_speculative_config({"method": "peagle", "model": "x", "num_speculative_tokens": 3}) == {
        "method": "eagle3", "parallel_drafting": True, "model": "x", "num_speculative_tokens": 3}
    head = _trained_head("peagle", target, greedy_run, str(tmp_path / "head"), 200)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "cli", "eval-drafter", "--model", target, "--drafter", head,
                           "--engine", "vllm", "--prompts", str(prompts), "--max-tokens", "16", "-k", "3",
                           "--no-ngram", "--json", str(out)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "engine vllm" in proc.stdout
    results = {r["method"]: r for r in json.loads(out.read_text())}
    (eagle,) = [r for m, r in results.items() if m.startswith("peagle")]
    assert set(results) == {"none", eagle["method"]}
    for r in results.values():  # each checked token for token against plain vLLM decoding
        assert r["error"] is None and r["lossless"] and not r["mismatches"], r
    assert eagle["num_drafts"] > 0 and len(eagle["acceptance_per_position"]) == 3
    assert eagle["mean_acceptance_length"] > 1.5  # it drafts what it was trained on
