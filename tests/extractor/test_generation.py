"""Generation: extraction never changes what the model generates; output-token rows equal a single forward."""

from __future__ import annotations

import pytest
import torch

from connectors import load_hidden_states, read_hidden_states_info
from extractor import LLM, SamplingParams
from harness.specs import spec_config
from tests.extractor.oracle import load_reference, reference_states

LAYERS = [1, 2, 4]
PROMPTS = ["The cat", "Write a number one two three four five six seven eight nine", "Hello there, quick red fox",
           "A", "Store load batch worker cluster node disk cloud bucket file path byte"]
INCLUDE = {"kv_transfer_params": {"include_output_tokens": True}}


@pytest.fixture(scope="module")
def llm_and_ref(tiny_model_factory, tmp_path_factory):
    from connectors import KVTransferConfig

    model_dir = tiny_model_factory("llama")
    out = tmp_path_factory.mktemp("gen-out")
    llm = LLM(model=model_dir, speculative_config=spec_config(LAYERS), dtype="float32", max_num_batched_tokens=64,
              kv_transfer_config=KVTransferConfig(kv_connector_extra_config={"shared_storage_path": str(out)}))
    yield llm, load_reference(model_dir)
    llm.shutdown()


def hf_greedy(model, ids, max_new_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_greedy_text_equals_plain_transformers_greedy_decoding(llm_and_ref):
    llm, (model, _) = llm_and_ref
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for out in outs:
        assert out.error is None
        assert out.outputs[0].token_ids == hf_greedy(model, out.prompt_token_ids, 12)
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_capturing_output_tokens_does_not_change_the_generated_text(llm_and_ref):
    llm, _ = llm_and_ref
    off = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    on = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, extra_args=INCLUDE))
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    # and batching does not either: each prompt alone gives the same tokens
    alone = [llm.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in off]


def test_include_output_tokens_stores_prompt_plus_output_minus_last_and_rows_equal_one_forward(llm_and_ref):
    llm, ref = llm_and_ref
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=INCLUDE) for n in (1, 3, 8, 5, 2)]
    outs = llm.generate(PROMPTS, params)
    for out, p in zip(outs, params):
        obj = load_hidden_states(out.kv_transfer_params["hidden_states_path"])
        gen = out.outputs[0].token_ids
        assert len(gen) == p.max_tokens
        expected_ids = out.prompt_token_ids + gen[:-1]
        assert obj["token_ids"].tolist() == expected_ids
        torch.testing.assert_close(obj["hidden_states"], reference_states(ref, expected_ids, LAYERS),
                                   rtol=1e-4, atol=1e-4)
        meta = read_hidden_states_info(out.kv_transfer_params["hidden_states_path"]).metadata
        assert meta["include_output_tokens"] == "true"
        assert meta["num_prompt_tokens"] == str(len(out.prompt_token_ids))


def test_without_include_output_tokens_only_prompt_tokens_are_stored(llm_and_ref):
    llm, ref = llm_and_ref
    (out,) = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    obj = load_hidden_states(out.kv_transfer_params["hidden_states_path"])
    assert obj["token_ids"].tolist() == out.prompt_token_ids
    assert len(out.outputs[0].token_ids) == 6
    torch.testing.assert_close(obj["hidden_states"], reference_states(ref, out.prompt_token_ids, LAYERS),
                               rtol=1e-4, atol=1e-4)


def test_a_seed_reproduces_sampling_whatever_the_batch(llm_and_ref):
    llm, _ = llm_and_ref
    p = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], p)[0].outputs[0].token_ids
    batched = llm.generate(PROMPTS, p)[2].outputs[0].token_ids
    assert alone == batched
    other = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=1.0, seed=99, ignore_eos=True))
    assert len(other[0].outputs[0].token_ids) == 8


def test_stop_tokens_eos_and_max_model_len_end_generation_with_the_right_reason(llm_and_ref, tiny_llama, kv_config):
    llm, (model, _) = llm_and_ref
    greedy = hf_greedy(model, llm.tokenizer(PROMPTS[1]).input_ids, 6)
    stop_at = greedy[2]
    (out,) = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop_at],
                                                       ignore_eos=True))
    assert out.outputs[0].token_ids == greedy[: greedy.index(stop_at) + 1]
    assert out.outputs[0].finish_reason == "stop"
    short = LLM(model=tiny_llama, speculative_config=spec_config(LAYERS), dtype="float32", max_model_len=12,
                kv_transfer_config=kv_config())
    ids = list(range(5, 15))  # 10 tokens: room for 2 more
    (out,) = short.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 2 and out.outputs[0].finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_model_factory, kv_config):
    # a model whose logits are all equal greedily picks id 0, which is EOS in the local tokenizer
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("qwen3")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    eos = model.config.eos_token_id
    assert eos == 0
    with torch.no_grad():
        model.lm_head.weight.zero_()
    biased = model_dir + "-eos"
    model.save_pretrained(biased)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model_dir).save_pretrained(biased)
    llm = LLM(model=biased, speculative_config=spec_config([1, 4]), dtype="float32", kv_transfer_config=kv_config())
    prompt = {"prompt_token_ids": [model.config.eos_token_id + 5] * 4}
    assert hf_greedy(model, prompt["prompt_token_ids"], 1) == [eos], "the biased model should greedily emit EOS"
    (stopped,) = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0))
    assert stopped.outputs[0].token_ids == [eos] and stopped.outputs[0].finish_reason == "stop"
    (ignored,) = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(ignored.outputs[0].token_ids) == 5 and ignored.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("connector", ["requested", "NullConnector"])
def test_requests_that_ask_for_no_file_generate_the_same_and_capture_nothing(connector, tiny_model_factory, tmp_path,
                                                                            monkeypatch):
    """files="requested" (hsx serve --no-files): a request without kv_transfer_params only generates; one with them
    ({} included) writes its file as every request does. KVTransferConfig(kv_connector="NullConnector"): none writes.
    Oracle: transformers' greedy decoding and forward; "nothing captured": the capture hooks' collect never runs for
    a batch in which no request writes."""
    from connectors import KVTransferConfig
    from extractor.layers import LayerCapture

    model_dir = tiny_model_factory("llama")
    model, _ = ref = load_reference(model_dir)
    kv = (KVTransferConfig(kv_connector="NullConnector") if connector == "NullConnector" else
          KVTransferConfig(kv_connector_extra_config={"shared_storage_path": str(tmp_path), "files": "requested"}))
    llm = LLM(model=model_dir, speculative_config=spec_config(LAYERS), dtype="float32", kv_transfer_config=kv)
    collected = []
    real_collect = LayerCapture.collect
    monkeypatch.setattr(LayerCapture, "collect", lambda self: collected.append(1) or real_collect(self))
    tok = llm.get_tokenizer()
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:3], plain)  # none asks for a file
    assert collected == [] and list(tmp_path.iterdir()) == []
    for prompt, out in zip(PROMPTS[:3], outs):
        assert out.error is None and out.kv_transfer_params is None and out.write_seconds is None
        assert out.outputs[0].token_ids == hf_greedy(model, tok(prompt).input_ids, 6)
    if connector == "NullConnector":  # asking for a file of an engine that writes none: that request's error
        (out,) = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": {}}))
        assert out.error_kind == "invalid" and "NullConnector" in out.error
        llm.shutdown()
        return
    asking = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args={"kv_transfer_params": {}}),
              plain, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args=INCLUDE)]
    outs = llm.generate(PROMPTS[:3], asking)
    assert [o.kv_transfer_params is None for o in outs] == [False, True, False]
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    for prompt, out, stored_outputs in zip(PROMPTS[:3], outs, (False, None, True)):
        ids = tok(prompt).input_ids
        assert out.outputs[0].token_ids == hf_greedy(model, ids, 6)
        if stored_outputs is None:
            continue
        want = ids + (out.outputs[0].token_ids[:-1] if stored_outputs else [])
        obj = load_hidden_states(out.kv_transfer_params["hidden_states_path"])
        assert obj["token_ids"].tolist() == want
        torch.testing.assert_close(obj["hidden_states"], reference_states(ref, want, LAYERS), rtol=1e-4, atol=1e-4)
    llm.shutdown()


@pytest.mark.parametrize("prompt_only", [False, True], ids=["generating", "prompt-only-packed"])
def test_fp8_quantized_on_the_device_writes_the_host_paths_file_bytes(prompt_only, tiny_model_factory, tmp_path):
    """On CUDA the runner converts fp8 (scales, cast) before the copy (LLM sets runner.device_storage); forced here on
    CPU, prompt and output-token rows across prefill chunks, and prompts packed in one row, must give the host path's
    file bytes exactly."""
    import safetensors.torch

    from connectors import KVTransferConfig

    model_dir = tiny_model_factory("llama")
    params = (SamplingParams(max_tokens=0) if prompt_only
              else SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, extra_args=INCLUDE))
    tensors = {}
    for where in ("host", "device"):
        llm = LLM(model=model_dir, speculative_config=spec_config(LAYERS), dtype="bfloat16",
                  max_num_batched_tokens=256 if prompt_only else 8,
                  kv_transfer_config=KVTransferConfig(kv_connector_extra_config={
                      "shared_storage_path": str(tmp_path / where), "storage_dtype": "fp8"}))
        assert llm.runner.device_storage is None  # CPU: the host converts
        if where == "device":
            llm.runner.device_storage = "float8_e4m3fn"
        outs = llm.generate(PROMPTS[:3], params)
        tensors[where] = [safetensors.torch.load_file(o.kv_transfer_params["hidden_states_path"]) for o in outs]
        llm.shutdown()
    for a, b in zip(tensors["host"], tensors["device"]):
        assert sorted(a) == sorted(b) and a["hidden_states"].dtype == torch.float8_e4m3fn
        assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
