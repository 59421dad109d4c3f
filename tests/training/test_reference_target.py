"""The reference target: a small Llama trained here on the stdlib's sources, cached, loadable, honest about its split.

One tiny build (seconds) is shared by the module; the default config's build (minutes) is measured by
benchmarks/bench_drafters.py, not here."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest
import torch

from reference.stdlib_corpus import is_heldout, stdlib_corpus
from reference.target import REPORT_NAME, ReferenceTargetConfig, build_reference_target, cache_key


def tiny_config(root: str, **overrides) -> ReferenceTargetConfig:
    kw = dict(hidden_size=32, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1,
              intermediate_size=64, vocab_size=320, context_length=48, batch_size=4, steps=16, warmup_steps=2,
              learning_rate=1e-2, max_train_files=4, heldout_blocks=4, num_prompts=4, prompt_tokens=24, threads=1,
              cache_root=root)
    kw.update(overrides)
    return ReferenceTargetConfig(**kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reference-target-cache"))
    config = tiny_config(root)
    train, heldout = stdlib_corpus(config.heldout_fraction)
    # a killed build's leftovers under the same name: a temp folder holding a loadable-looking but wrong checkpoint
    stale = os.path.join(root, f".tmp-{cache_key(config, train[:4], heldout)}-1-deadbeef")
    os.makedirs(stale)
    with open(os.path.join(stale, "config.json"), "w") as f:
        f.write("{not json")
    started = time.perf_counter()
    target = build_reference_target(config, progress=False)
    return config, target, time.perf_counter() - started, stale


@pytest.mark.slow  # shares one tiny build: ~10 s of CPU
def test_the_build_trains_and_records_its_losses(built):
    config, target, _, _ = built
    assert not target.cached
    report = json.load(open(os.path.join(target.path, REPORT_NAME)))
    assert report == target.report
    # random init predicts ~uniformly: loss ln(V); training must get well below it, on train and held-out text
    uniform = torch.log(torch.tensor(float(config.vocab_size))).item()
    assert report["first_loss"] > uniform - 0.5
    assert report["final_train_loss"] < report["first_loss"] - 0.5
    assert report["heldout_loss"] < uniform - 0.3
    assert report["heldout_perplexity"] == pytest.approx(torch.exp(torch.tensor(report["heldout_loss"])).item(),
                                                         rel=1e-4)
    assert report["train_files"] == 4 and report["train_tokens_seen"] == 16 * 4 * 48


@pytest.mark.slow  # shares one tiny build: ~10 s of CPU
def test_the_checkpoint_loads_in_transformers_and_in_hsx_with_the_same_greedy_output(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from extractor import LLM, SamplingParams

    _, target, _, _ = built
    tokenizer = AutoTokenizer.from_pretrained(target.path)
    model = AutoModelForCausalLM.from_pretrained(target.path).eval()
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 8
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert len(tokenizer) == model.config.vocab_size
    prompt = target.prompts[0]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == prompt  # byte-level BPE round-trips source text
    with torch.no_grad():
        oracle = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8,
                                pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
    llm = LLM(model=target.path)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.error is None
    assert out.outputs[0].token_ids == oracle


@pytest.mark.slow  # shares one tiny build: ~10 s of CPU
def test_a_second_call_returns_the_cached_folder_without_training(built):
    config, target, first_s, _ = built
    weights = os.path.join(target.path, "model.safetensors")
    mtime = os.path.getmtime(weights)
    started = time.perf_counter()
    again = build_reference_target(config, progress=False)
    elapsed = time.perf_counter() - started
    assert again.cached and again.path == target.path and again.prompts == target.prompts
    assert os.path.getmtime(weights) == mtime
    assert elapsed < first_s / 3  # no training (the weights' mtime above); not a timing target
    # threads and cache root do not change what is built; training fields do
    assert build_reference_target(dataclasses.replace(config, threads=2), progress=False).path == target.path
    train, heldout = stdlib_corpus(config.heldout_fraction)
    assert cache_key(dataclasses.replace(config, steps=17), train[:4], heldout) != os.path.basename(target.path)


@pytest.mark.slow  # shares one tiny build: ~10 s of CPU
def test_a_half_written_temp_folder_is_never_used(built):
    _, target, _, stale = built
    assert os.path.isdir(stale)  # left alone (removed only once it is a day old) ...
    assert target.path != stale and os.path.dirname(target.path) == os.path.dirname(stale)
    assert not os.path.basename(target.path).startswith(".")  # ... and the build trained its own checkpoint
    json.load(open(os.path.join(target.path, "config.json")))


@pytest.mark.slow  # shares one tiny build: ~10 s of CPU
def test_a_final_folder_without_its_report_is_rebuilt(tmp_path):
    config = tiny_config(str(tmp_path), steps=2, warmup_steps=1)
    train, heldout = stdlib_corpus(config.heldout_fraction)
    broken = tmp_path / cache_key(config, train[:4], heldout)
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # e.g. copied by hand, half-way
    target = build_reference_target(config, progress=False)
    assert not target.cached and target.path == str(broken)
    assert (broken / REPORT_NAME).is_file() and (broken / "model.safetensors").is_file()


@pytest.mark.slow  # shares one tiny build: ~10 s of CPU
def test_held_out_files_are_disjoint_from_train_files_and_prompts_come_from_them(built):
    config, target, _, _ = built
    train, heldout = stdlib_corpus(config.heldout_fraction)
    train_rel, heldout_rel = {f.rel for f in train}, {f.rel for f in heldout}
    assert train_rel and heldout_rel and not train_rel & heldout_rel
    assert all(is_heldout(r, config.heldout_fraction) for r in heldout_rel)
    assert 0.03 < len(heldout_rel) / (len(train_rel) + len(heldout_rel)) < 0.2  # ~heldout_fraction of the files
    assert not any("site-packages" in r or "/test" in r or r.startswith("test") for r in train_rel | heldout_rel)
    assert {f.rel for f in target.train_files} <= train_rel
    heldout_texts = [f.read() for f in target.heldout_files]
    assert len(target.prompts) == config.num_prompts
    assert all(any(p in text for text in heldout_texts) for p in target.prompts)


def test_a_target_too_shallow_for_eagle3_aux_layers_is_refused():
    with pytest.raises(ValueError, match="at least 8"):
        ReferenceTargetConfig(num_hidden_layers=4)
    with pytest.raises(ValueError, match="does not divide"):
        ReferenceTargetConfig(hidden_size=130)


@pytest.mark.parametrize("arch,prefix", [("deepseek_v3", "model.layers.8."), ("qwen3_next", "mtp.layers.0.")])
def test_an_mtp_reference_target_ships_trained_mtp_layers_in_its_familys_layout(arch, prefix, tmp_path):
    """architecture + mtp_layers: the target's checkpoint holds its MTP layer where its family's checkpoints do, the
    config declares it, the layer learned (held-out loss under a uniform guess), and method mtp decodes with it
    losslessly; a Llama with MTP layers, or an unknown architecture, is refused."""
    import math

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from extractor import LLM, SamplingParams

    target = build_reference_target(tiny_config(str(tmp_path), architecture=arch, mtp_layers=1, steps=24),
                                    progress=False)
    with open(os.path.join(target.path, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    with safe_open(os.path.join(target.path, "model.safetensors"), framework="pt") as f:
        assert any(k.startswith(prefix) for k in f.keys())
    assert target.report["mtp_heldout_loss"] < math.log(320) and 0 <= target.report["mtp_heldout_top1"] <= 1
    model = AutoModelForCausalLM.from_pretrained(target.path).eval()
    llm = LLM(target.path, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    outs = llm.generate(list(target.prompts[:2]), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for out in outs:
        ids = out.prompt_token_ids
        want = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                              eos_token_id=None)[0, len(ids):].tolist()
        assert list(out.outputs[0].token_ids) == want
    with pytest.raises(ValueError, match="MTP layers need architecture"):
        tiny_config(str(tmp_path), mtp_layers=1)
    with pytest.raises(ValueError, match="one MTP layer"):
        tiny_config(str(tmp_path), architecture=arch, mtp_layers=2)
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        tiny_config(str(tmp_path), architecture="gpt2")
