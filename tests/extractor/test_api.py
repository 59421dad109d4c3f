"""The offline API: vLLM's example ported, configuration errors, per-request failures, custom paths, early exit."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

from connectors import KVTransferConfig, example_hidden_states_connector
from extractor import LLM, SamplingParams
from extractor.layers import default_layer_ids, find_decoder_layers
from harness.specs import spec_config
from tests.extractor.oracle import load_reference, reference_states


def test_the_vllm_offline_example_runs_with_only_imports_and_model_changed(tiny_llama, tmp_path):
    # --- vLLM's example, verbatim but for the imports and the model ---
    tmpdir = str(tmp_path)
    model = tiny_llama
    prompts = ["Hello, my name is", "The capital of France is"]
    llm = LLM(
        model=model,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}},
        },
        kv_transfer_config=KVTransferConfig(
            kv_connector="ExampleHiddenStatesConnector",
            kv_role="kv_producer",
            kv_connector_extra_config={"shared_storage_path": tmpdir, "allow_custom_save_path": True},
        ),
    )
    sampling_params = [
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=10, extra_args={"kv_transfer_params": {
            "hidden_states_path": os.path.join(tmpdir, "custom_output.safetensors"),
            "include_output_tokens": True}}),
    ]
    seen = []
    for output in llm.generate(prompts, sampling_params):
        path = output.kv_transfer_params.get("hidden_states_path")
        obj = example_hidden_states_connector.load_hidden_states(path)
        seen.append((path, obj["token_ids"].tolist(), obj["hidden_states"].shape, output))
        example_hidden_states_connector.cleanup_hidden_states(path)
        assert not os.path.exists(path)
    # --- checks ---
    (p0, ids0, shape0, out0), (p1, ids1, shape1, out1) = seen
    assert p0 == os.path.join(tmpdir, f"{out0.request_id}.safetensors")
    assert p1 == os.path.join(tmpdir, "custom_output.safetensors")
    assert ids0 == out0.prompt_token_ids and shape0 == (len(ids0), 4, 64)
    gen = out1.outputs[0].token_ids
    assert 1 <= len(gen) <= 10
    assert ids1 == out1.prompt_token_ids + gen[:-1] and shape1 == (len(ids1), 4, 64)


def test_unsupported_speculative_configs_are_clear_errors(tiny_llama):
    with pytest.raises(ValueError, match="method 'eagle3' needs 'model'"):
        LLM(model=tiny_llama, speculative_config={"method": "eagle3", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="method 'eagle' needs 'model'"):
        LLM(model=tiny_llama, speculative_config={"method": "eagle", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="declares no MTP layers"):  # tests/drafters/test_mtp.py: targets with them
        LLM(model=tiny_llama, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match=r"max_model_len=99999 is more than .*max_position_embeddings=4096"):
        LLM(model=tiny_llama, max_model_len=99999)
    with pytest.raises(ValueError, match="requires exactly 1"):
        LLM(model=tiny_llama, speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        LLM(model=tiny_llama, speculative_config={"method": "extract_hidden_states", "prompt_lookup_max": 3})
    with pytest.raises(TypeError, match="does not support.*tensor_parallel_size"):
        LLM(model=tiny_llama, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        LLM(model=tiny_llama, dtype="int8")


@pytest.mark.parametrize("ids, match", [([0, 5], r"out of range.*valid ids are 0\.\.4"),
                                        ([-1, 2], r"out of range.*0\.\.4"),
                                        ([1, 1], "duplicates"),
                                        ([], "empty")])
def test_bad_layer_ids_name_the_valid_range(tiny_llama, ids, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=tiny_llama, speculative_config=spec_config(ids))


def test_omitted_layer_ids_default_to_eagle3_layers_plus_the_last(tiny_model_factory, kv_config):
    assert default_layer_ids(32) == (2, 16, 29, 32)
    assert default_layer_ids(8) == (2, 4, 5, 8)
    assert default_layer_ids(4) == (2, 1, 4)  # N//2 == 2 repeats: kept once
    model_dir = tiny_model_factory("llama", num_hidden_layers=8)
    llm = LLM(model=model_dir, speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1},
              kv_transfer_config=kv_config(), dtype="float32")
    assert llm.spec.layer_ids == (2, 4, 5, 8)
    (out,) = llm.generate(["The dog"], SamplingParams(max_tokens=0))
    hs = example_hidden_states_connector.load_hidden_states(out.kv_transfer_params["hidden_states_path"])
    torch.testing.assert_close(hs["hidden_states"], reference_states(load_reference(model_dir),
                                                                     out.prompt_token_ids, [2, 4, 5, 8]),
                               rtol=1e-4, atol=1e-4)


def test_a_bad_request_fails_alone_and_the_batch_completes(tiny_llama, kv_config, tmp_path, caplog):
    llm = LLM(model=tiny_llama, speculative_config=spec_config([1, 4]), dtype="float32", max_model_len=40,
              kv_transfer_config=kv_config())
    outside = str(tmp_path / "elsewhere" / "x.safetensors")
    prompts = ["The cat", "", {"prompt_token_ids": list(range(5, 55))}, "The dog jumps",
               {"prompt_token_ids": [3, 999_999]}, {"text": "no prompt key"}, 42, "Far river"]
    params = [SamplingParams(max_tokens=0)] * 7 + [
        SamplingParams(max_tokens=0, extra_args={"kv_transfer_params": {"hidden_states_path": outside}})]
    prompts.append("A tree")
    params.append(SamplingParams(max_tokens=3, temperature=0))
    outs = llm.generate(prompts, params)
    errors = [o.error for o in outs]
    assert errors[0] is None and errors[3] is None and errors[8] is None
    assert "empty" in errors[1]
    assert "50 tokens" in errors[2] and "max_model_len=40" in errors[2]
    assert "outside the vocabulary" in errors[4]
    assert "'prompt' or 'prompt_token_ids'" in errors[5]
    assert "must be a str or a dict" in errors[6]
    assert "outside the allowed roots" in errors[7]
    assert not os.path.exists(outside) and not os.path.exists(os.path.dirname(outside))
    for i in (1, 2, 4, 5, 6, 7):
        assert outs[i].kv_transfer_params is None and outs[i].outputs[0].finish_reason is None
    for i in (0, 3, 8):
        assert os.path.exists(outs[i].kv_transfer_params["hidden_states_path"])
    assert len(outs[8].outputs[0].token_ids) >= 1


def test_custom_paths_land_where_asked_inside_the_root_and_are_ignored_when_not_allowed(tiny_llama, kv_config,
                                                                                      tmp_path, caplog):
    root = tmp_path / "hs"
    llm = LLM(model=tiny_llama, speculative_config=spec_config([2]), dtype="float32", kv_transfer_config=kv_config())
    custom = str(root / "deep" / "er" / "mine.safetensors")
    relative = "rel/dir/r.safetensors"
    outs = llm.generate(["a", "b"], [
        SamplingParams(max_tokens=0, extra_args={"kv_transfer_params": {"hidden_states_path": custom}}),
        SamplingParams(max_tokens=0, extra_args={"kv_transfer_params": {"hidden_states_path": relative}})])
    assert outs[0].kv_transfer_params["hidden_states_path"] == custom and os.path.exists(custom)
    assert outs[1].kv_transfer_params["hidden_states_path"] == str(root / relative)
    assert os.path.exists(root / relative)

    strict = LLM(model=tiny_llama, speculative_config=spec_config([2]), dtype="float32",
                 kv_transfer_config=kv_config(allow_custom_save_path=False, shared_storage_path=str(tmp_path / "s")))
    with caplog.at_level(logging.WARNING):
        (out,) = strict.generate(["a"], SamplingParams(max_tokens=0, extra_args={"kv_transfer_params": {
            "hidden_states_path": str(tmp_path / "s" / "ignored.safetensors")}}), request_ids=["req-7"])
    assert out.kv_transfer_params["hidden_states_path"] == str(tmp_path / "s" / "req-7.safetensors")
    assert not os.path.exists(tmp_path / "s" / "ignored.safetensors")
    assert "allow_custom_save_path is off" in caplog.text


def test_prompt_forms_and_chat_give_the_same_tokens_as_the_tokenizer(tiny_llama, kv_config):
    llm = LLM(model=tiny_llama, speculative_config=spec_config([1]), dtype="float32", kv_transfer_config=kv_config())
    text = "The quick dog"
    ids = llm.tokenizer(text).input_ids
    outs = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}], SamplingParams(max_tokens=0))
    assert [o.prompt_token_ids for o in outs] == [ids] * 3
    messages = [{"role": "user", "content": "hello there"}]
    (chat,) = llm.chat(messages, SamplingParams(max_tokens=0))
    expected = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
    assert chat.prompt_token_ids == list(expected)
    hs = example_hidden_states_connector.load_hidden_states(chat.kv_transfer_params["hidden_states_path"])
    assert hs["token_ids"].tolist() == list(expected)


def test_loss_mask_and_sample_id_from_pretokenized_prompts_are_stored(tiny_llama, kv_config):
    llm = LLM(model=tiny_llama, speculative_config=spec_config([1, 3]), dtype="float32", kv_transfer_config=kv_config())
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1], "sample_id": "conv-9"}],
                          SamplingParams(max_tokens=0))
    path = out.kv_transfer_params["hidden_states_path"]
    assert example_hidden_states_connector.load_hidden_states(path)["loss_mask"].tolist() == [0, 0, 1, 1]
    assert example_hidden_states_connector.read_hidden_states_info(path).metadata["sample_id"] == "conv-9"
    (bad,) = llm.generate([{"prompt_token_ids": [5, 6], "loss_mask": [1]}], SamplingParams(max_tokens=0))
    assert "loss_mask has 1 values for 2 prompt tokens" in bad.error


def test_prompt_only_extraction_skips_the_lm_head_and_stops_after_the_deepest_layer(tiny_model_factory, kv_config):
    model_dir = tiny_model_factory("llama", num_hidden_layers=8)
    llm = LLM(model=model_dir, speculative_config=spec_config([0, 2, 4]), dtype="float32",
              kv_transfer_config=kv_config())
    calls = {"layer5": 0, "layer3": 0, "lm_head": 0, "norm": 0}
    layers = find_decoder_layers(llm.runner.model, 8)

    def counter(name):
        def hook(*_):
            calls[name] += 1
        return hook

    handles = [layers[4].register_forward_hook(counter("layer5")), layers[2].register_forward_hook(counter("layer3")),
               llm.runner.model.lm_head.register_forward_hook(counter("lm_head")),
               llm.runner.model.model.norm.register_forward_hook(counter("norm"))]
    outs = llm.generate(["one two", "three four five"], SamplingParams(max_tokens=0))
    assert calls == {"layer5": 0, "layer3": 1, "lm_head": 0, "norm": 0}  # one batch; stopped after layer id 4
    llm.generate(["one two"], SamplingParams(max_tokens=2, temperature=0))
    assert calls["lm_head"] >= 1 and calls["layer5"] >= 1  # generation runs the whole model
    for h in handles:
        h.remove()
    ref = load_reference(model_dir)
    for o in outs:
        hs = example_hidden_states_connector.load_hidden_states(o.kv_transfer_params["hidden_states_path"])
        torch.testing.assert_close(hs["hidden_states"], reference_states(ref, o.prompt_token_ids, [0, 2, 4]),
                                   rtol=1e-4, atol=1e-4)


def test_an_architecture_without_findable_decoder_layers_names_the_supported_families():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])

    with pytest.raises(ValueError, match="supports decoder-only HF causal LMs such as llama.*gpt2"):
        find_decoder_layers(Odd(), 3)


def test_sampling_params_validate_their_fields():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="unknown kv_transfer_params keys"):
        SamplingParams(extra_args={"kv_transfer_params": {"path": "x"}})
    for bad in (float("inf"), float("nan"), -0.5):
        with pytest.raises(ValueError, match="temperature must be a finite number"):
            SamplingParams(temperature=bad)
    for bad in (1 << 64, -(1 << 63) - 1, 1.5, True):  # torch's generator would overflow at the first sample
        with pytest.raises(ValueError, match="seed must be an integer in"):
            SamplingParams(seed=bad)
    SamplingParams(seed=(1 << 64) - 1)
    SamplingParams(seed=-(1 << 63))
    import numpy as np

    assert SamplingParams(seed=np.int64(7)).seed == 7  # integer scalars are integers


def test_after_an_early_exit_extraction_the_model_still_runs_to_the_end(tiny_llama, kv_config):
    llm = LLM(model=tiny_llama, speculative_config=spec_config([1]), dtype="float32", kv_transfer_config=kv_config())
    llm.generate(["one two three"], SamplingParams(max_tokens=0))
    with torch.no_grad():
        logits = llm.runner.model(torch.tensor([[5, 6, 7]], device=llm.runner.device)).logits  # a plain forward, outside the engine
    assert logits.shape == (1, 3, llm.runner.vocab_size)


@pytest.mark.parametrize("ids, kwargs, param, code", [
    ([], {}, "prompt", "empty_prompt"),
    (list(range(9)), {"max_prompt_tokens": 8}, "prompt", "prompt_too_long"),
    ([1, 99], {}, "prompt", "invalid_token_ids"),
    (list(range(16)), {"max_tokens": 1}, "max_tokens", "prompt_too_long"),
    ([1, 2], {"max_tokens": 15}, "max_tokens", "max_tokens_too_large"),
    ([1, 2], {"stop_token_ids": [50]}, "stop_token_ids", "invalid_token_ids"),
    ([1, 2], {"loss_mask": [1]}, "loss_mask", "invalid_loss_mask"),
])
def test_one_request_check_names_the_parameter_and_the_kind(ids, kwargs, param, code):
    """extractor.request.check_request: what LLM.generate and hsx serve's admission both check (serve maps it onto
    its 400s), against a 16-token context and a 32-token vocabulary."""
    from extractor.request import RequestRejected, check_request

    with pytest.raises(RequestRejected) as e:
        check_request(ids, max_model_len=16, vocab_size=32, **{"max_tokens": 0, **kwargs})
    assert (e.value.param, e.value.code) == (param, code)
    assert check_request([1, 2], max_model_len=16, vocab_size=32, max_tokens=None) == 14  # the rest of the context
