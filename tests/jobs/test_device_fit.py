"""`hsx estimate`'s device figures (jobs/device_fit.py): parameters and cache sizes against what transformers actually
allocates, the smallest tensor-parallel size that fits a device, and the CLI's lines."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from jobs.device_fit import device_fit, parse_size


def _fit(model_dir: str, **kw):
    from transformers import AutoConfig

    args = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=2, captured_layers=3)
    args.update(kw)
    return device_fit(AutoConfig.from_pretrained(model_dir), **args)


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "gemma2"])
def test_parameters_and_cache_per_token_are_what_transformers_holds(tiny_model_factory, family):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, DynamicCache

    model_dir = tiny_model_factory(family)
    fit = _fit(model_dir)
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert fit.parameters == stored and fit.weight_bytes == 4 * stored
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cache = DynamicCache(config=model.config)
    tokens = 6  # shorter than the tiny windows: every windowed layer still holds every token
    with torch.no_grad():
        model(input_ids=torch.arange(5, 5 + tokens)[None], past_key_values=cache, use_cache=True)
    held = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers
               if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4) * 4
    assert fit.kv_bytes_per_token == held // tokens


def test_the_smallest_tensor_parallel_size_that_fits_names_its_engine(tiny_llama):
    whole = _fit(tiny_llama, device_memory=1 << 40).per_rank_bytes[1]
    one = _fit(tiny_llama, device_memory=int(whole / 0.9) + 1)
    assert one.tensor_parallel_size == 1 and "hsx's engine or --engine vllm" in one.engine
    half = _fit(tiny_llama, device_memory=int(one.per_rank_bytes[2] / 0.9) + 1)
    assert half.tensor_parallel_size == 2 and "--engine vllm --tensor-parallel-size 2" in half.engine
    assert list(half.per_rank_bytes) == [1, 2, 4]  # 4 attention heads: 8 does not divide them
    none = _fit(tiny_llama, device_memory=1000)
    assert none.tensor_parallel_size is None and "no tensor-parallel size" in none.lines()[-1]


def test_sizes_parse_in_both_units_and_nonsense_is_refused():
    assert parse_size("80GiB") == 80 << 30 and parse_size("141 GB") == 141 * 10 ** 9 and parse_size("24g") == 24e9
    assert parse_size("1024") == 1024
    with pytest.raises(ValueError, match="--device-memory 'lots'"):
        parse_size("lots")


def test_hsx_estimate_prints_the_fit_and_refuses_a_bad_size(tiny_llama, tmp_path, capsys):
    from cli.main import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"id": str(i), "text": "one two three four"}) for i in range(3)) + "\n")
    assert main(["estimate", "--model", tiny_llama, "--corpus", str(corpus), "--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "weights:" in out and "fits:     tensor-parallel size 1: hsx's engine or --engine vllm" in out
    for size, message in (("lots", "--device-memory 'lots'"), ("0", "--device-memory '0' is no memory"),
                          ("0GiB", "--device-memory '0GiB' is no memory")):  # 0 printed "0 B usable", exit 0
        with pytest.raises(SystemExit) as e:
            main(["estimate", "--model", tiny_llama, "--corpus", str(corpus), "--device-memory", size])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_mla_keeps_its_whole_latent_on_every_rank_and_heads_are_never_split_below_one(tiny_model_factory):
    """vLLM keeps DeepSeek's MLA latent whole on every tensor-parallel rank, and a rank holds at least one key/value
    head: the cache does not shrink 1/T past that (an estimate that assumed so would suggest a T that cannot load)."""
    mla = _fit(tiny_model_factory("deepseek_v3"), device_memory=1 << 40)
    assert mla.per_rank_bytes[2] - mla.weight_bytes // 2 == mla.per_rank_bytes[1] - mla.weight_bytes
    gqa = _fit(tiny_model_factory("llama"), device_memory=1 << 40)  # 2 key/value heads
    kv = gqa.kv_cache_bytes
    assert gqa.per_rank_bytes[4] - gqa.weight_bytes // 4 - gqa.activation_bytes == kv // 2  # one head of two


def test_estimate_without_device_memory_builds_no_model(tiny_llama, tmp_path, capsys):
    from cli.main import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "text": "one two"}) + "\n")
    assert main(["estimate", "--model", tiny_llama, "--corpus", str(corpus)]) == 0
    assert "weights:" not in capsys.readouterr().out
