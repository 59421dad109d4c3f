"""vLLM's speculative-decoding examples run on hsx by an import swap, and hsx's own examples/spec_decode.py runs.

The call sequences below are those of vLLM's examples/offline_inference/spec_decode.py (LLM(...) with its arguments,
generate or chat on token-id prompts, get_metrics(), the acceptance lines it prints) and mlpspeculator.py (timed
generation without and with a speculative config), written fresh against the tiny local models.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import time

import pytest

from extractor import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams
from extractor.metrics import Counter, Vector  # vLLM: from vllm.v1.metrics.reader import Counter, Vector

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K = 3
# what spec_decode.py passes to LLM() besides model and speculative_config, at its flags' defaults
SEED_LLM_ARGS = dict(trust_remote_code=True, tensor_parallel_size=1, enable_chunked_prefill=False, enforce_eager=False,
                     gpu_memory_utilization=0.9, disable_log_stats=False, max_model_len=16384,
                     limit_mm_per_prompt={"image": 5}, disable_chunked_mm_input=True, max_num_seqs=None,
                     allowed_local_media_path="")


def _seed_spec_config(method: str, draft: str | None) -> dict:
    """speculative_config as spec_decode.py builds it for `method` at its flags' defaults (k = --num-spec-tokens)."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": K, "enforce_eager": False,
            "max_model_len": 16384, "parallel_drafting": False}


def _print_acceptance(outputs, metrics, k: int) -> tuple[dict, float]:
    """spec_decode.py's metric loop and printed lines."""
    total_num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_drafts = num_draft_tokens = num_accepted_tokens = 0
    acceptance_counts = [0] * k
    for metric in metrics:
        if metric.name == "vllm:spec_decode_num_drafts":
            assert isinstance(metric, Counter)
            num_drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            assert isinstance(metric, Counter)
            num_draft_tokens += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            assert isinstance(metric, Counter)
            num_accepted_tokens += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            assert isinstance(metric, Vector)
            for pos in range(len(metric.values)):
                acceptance_counts[pos] += metric.values[pos]
    print("-" * 50)
    print(f"total_num_output_tokens: {total_num_output_tokens}")
    print(f"num_drafts: {num_drafts}")
    print(f"num_draft_tokens: {num_draft_tokens}")
    print(f"num_accepted_tokens: {num_accepted_tokens}")
    acceptance_length = 1 + (num_accepted_tokens / num_drafts) if num_drafts > 0 else 1
    print(f"mean acceptance length: {acceptance_length:.2f}")
    print("-" * 50)
    for i in range(len(acceptance_counts)):
        acceptance_rate = acceptance_counts[i] / num_drafts if num_drafts > 0 else 0
        print(f"acceptance at token {i}: {acceptance_rate:.2f}")
    counts = {"output": total_num_output_tokens, "drafts": num_drafts, "draft_tokens": num_draft_tokens,
              "accepted": num_accepted_tokens, "per_pos": acceptance_counts}
    return counts, acceptance_length


def _check_printed(text: str, counts: dict, acceptance_length: float, k: int) -> None:
    assert f"total_num_output_tokens: {counts['output']}\n" in text
    assert f"num_drafts: {counts['drafts']}\n" in text
    assert f"num_draft_tokens: {counts['draft_tokens']}\n" in text
    assert f"num_accepted_tokens: {counts['accepted']}\n" in text
    assert f"mean acceptance length: {acceptance_length:.2f}\n" in text
    for i in range(k):
        assert f"acceptance at token {i}: " in text


@pytest.fixture(scope="module")
def seed_llama(tiny_model_factory):
    """The tiny Llama with room for the seed's max_model_len=16384 (hsx refuses a length past the model's)."""
    return tiny_model_factory("llama", max_position_embeddings=16384)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_spec_decode_script_call_sequence(method, seed_llama, capsys, caplog):
    """spec_decode.py: LLM(model, **seed args, speculative_config), token-id prompts, generate, chat, get_metrics."""
    from transformers import AutoTokenizer

    from reference.tiny_models import sample_text

    tokenizer = AutoTokenizer.from_pretrained(seed_llama)
    prompts = sample_text(6, seed=3) + ["one two three four one two three four one two three four"]
    # get_samples + "add_special_tokens is False to avoid adding bos twice"; multi_modal_data None for text datasets
    llm_prompts = [{"prompt_token_ids": tokenizer.encode(p, add_special_tokens=False), "multi_modal_data": None}
                   for p in prompts]
    with caplog.at_level(logging.WARNING):
        # draft_model: the target itself as draft, so every drafted token must be accepted
        llm = LLM(model=seed_llama, speculative_config=_seed_spec_config(method, seed_llama), **SEED_LLM_ARGS)
    warned = [r.getMessage() for r in caplog.records if "no effect in hsx" in r.getMessage()]
    llm_warnings = [m for m in warned if m.startswith("LLM()")]
    assert len(llm_warnings) == 1 and "gpu_memory_utilization" in llm_warnings[0], warned
    spec_warnings = [m for m in warned if m.startswith("speculative_config")]
    assert len(spec_warnings) == (method == "draft_model"), warned

    sampling_params = SamplingParams(temperature=0, max_tokens=24)
    outputs = llm.generate(llm_prompts, sampling_params=sampling_params)  # --backend openai (default)
    assert all(o.ok for o in outputs), [o.error for o in outputs]
    chat_outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts[:2]],  # --backend openai-chat
                            sampling_params=sampling_params)
    assert all(o.ok and o.outputs[0].token_ids for o in chat_outputs)

    (refused,) = llm.generate([{**llm_prompts[0], "multi_modal_data": {"image": "x.jpg"}}], sampling_params)
    assert "text-only target" in refused.error and "multi_modal_data" in refused.error

    counts, acceptance_length = _print_acceptance(outputs + chat_outputs, llm.get_metrics(), K)
    _check_printed(capsys.readouterr().out, counts, acceptance_length, K)
    assert counts["drafts"] > 0 and counts["draft_tokens"] <= K * counts["drafts"]
    assert sum(counts["per_pos"]) == counts["accepted"]
    assert counts["per_pos"] == sorted(counts["per_pos"], reverse=True)  # position i accepted => i-1 accepted
    if method == "draft_model":
        assert counts["accepted"] == counts["draft_tokens"] and acceptance_length > 2


def _time_generation(llm, prompts, sampling_params, title):
    """mlpspeculator.py's timing: two warm-up generates, one timed, seconds per output token, the texts."""
    llm.generate(prompts, sampling_params)
    llm.generate(prompts, sampling_params)
    start = time.time()
    outputs = llm.generate(prompts, sampling_params)
    end = time.time()
    print("-" * 50)
    print(title)
    print("time: ", (end - start) / sum(len(o.outputs[0].token_ids) for o in outputs))
    for output in outputs:
        print(f"text: {output.outputs[0].text!r}")
        print("-" * 50)
    return [o.outputs[0].text for o in outputs]


def test_mlpspeculator_script_flow(tiny_llama, tiny_model_factory, tmp_path, capsys):
    """mlpspeculator.py as written: speculative_config={"model": ACCELERATOR} with an MLPSpeculator checkpoint (no
    method, no k: both read from its config.json, as vLLM does); timed with and without speculation, and greedy,
    the texts equal the plain engine's. A causal LM given that way is a draft_model draft and needs k."""
    from drafters.mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorDrafter

    accelerator = str(tmp_path / "accelerator")  # untrained: losslessness holds whatever it drafts
    MLPSpeculatorDrafter(MLPSpeculatorConfig(n_predict=K), hidden_size=64, vocab_size=512).save_pretrained(
        accelerator, verifier=tiny_llama)
    draft = tiny_model_factory("llama", num_hidden_layers=2)
    with pytest.raises(ValueError, match="method 'draft_model' needs num_speculative_tokens"):
        LLM(model=tiny_llama, speculative_config={"model": draft})
    with pytest.raises(ValueError, match="'mlp_speculator' but .* holds a causal LM.*use method 'draft_model'"):
        LLM(model=tiny_llama, speculative_config={"method": "mlp_speculator", "model": draft,
                                                   "num_speculative_tokens": 2})

    template = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                "request.\n\n### Instruction:\n{}\n\n### Response:\n")
    prompts = [template.format("Write about the president of the United States.")]
    sampling_params = SamplingParams(temperature=0.0, max_tokens=48)  # the script: 200

    llm = LLM(model=tiny_llama)
    plain = _time_generation(llm, prompts, sampling_params, "Without speculation")
    del llm
    gc.collect()
    llm = LLM(model=tiny_llama, speculative_config={"model": accelerator})
    assert llm.config.speculative.method == "mlp_speculator" and llm.config.speculative.num_speculative_tokens == K
    spec = _time_generation(llm, prompts, sampling_params, "With speculation")
    out = capsys.readouterr().out
    assert out.count("time:  ") == 2 and "Without speculation\n" in out and "With speculation\n" in out
    assert spec == plain
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:spec_decode_num_drafts"].value > 0
    assert len(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values) == K


def _example_lines(text: str, k: int) -> None:
    for name in ("total_num_output_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f"\n{name}: " in text, text
    assert "mean acceptance length: " in text
    assert [f"acceptance at token {i}: " in text for i in range(k + 1)] == [True] * k + [False]


def test_example_builds_tiny_models_and_prints_acceptance():
    """examples/spec_decode.py with no --model: builds a tiny target and a 2-layer draft, prints vLLM's lines."""
    cmd = [sys.executable, os.path.join(ROOT, "examples", "spec_decode.py"), "--method", "draft_model",
           "--num-spec-tokens", "2", "--num-prompts", "2", "--output-len", "8"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    _example_lines(done.stdout, 2)


@pytest.mark.parametrize("layout", ["jsonl", "sharegpt"])
def test_example_reads_local_datasets(layout, tiny_llama, tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import spec_decode
    finally:
        sys.path.pop(0)
    texts = ["the model the model the model", "a token a token a token a token"]
    rows = [{"prompt": t} for t in texts] if layout == "jsonl" else \
        [{"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "x"}]} for t in texts]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert spec_decode.load_prompts(str(path), 8) == texts
    al = spec_decode.main(["--method", "ngram", "--model", tiny_llama, "--dataset-path", str(path),
                           "--num-spec-tokens", "3", "--output-len", "12", "--prompt-lookup-min", "1"])
    out = capsys.readouterr().out
    _example_lines(out, 3)
    assert f"mean acceptance length: {al:.2f}" in out


def test_example_runs_custom_mm_prompts_on_a_vision_language_target():
    """--custom-mm-prompts (vLLM's flag): chats about pictures drawn here, loaded from local files, on a tiny random
    Qwen2.5-VL; prints vLLM's lines."""
    cmd = [sys.executable, os.path.join(ROOT, "examples", "spec_decode.py"), "--custom-mm-prompts", "--backend",
           "openai-chat", "--method", "ngram", "--num-spec-tokens", "2", "--num-prompts", "3", "--output-len", "8",
           "--print-output"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("prompt: [scene-") == 3
    _example_lines(done.stdout, 2)
