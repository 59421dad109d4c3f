"""The CUDA path: states copied through pinned host memory, bf16 kept as bf16, checked against a plain transformers
forward on the same device. Skipped where there is no CUDA device (CI); every other engine test also runs on CUDA
when one is present, since `LLM` picks it by default."""

from __future__ import annotations

import pytest
import torch

from connectors import load_hidden_states, read_hidden_states_info
from extractor import LLM, SamplingParams
from harness.specs import spec_config
from tests.extractor.oracle import load_reference, reference_states
from tests.extractor.test_oracle import ORDERED, mixed_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def assert_close_for(dtype: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    if dtype == "float32":  # no TF32 for matmuls by default: batched and unbatched agree to rounding
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        return
    # bf16: other batch shapes pick other GEMM kernels, so rows differ by a few ulps (8 mantissa bits) and that
    # compounds over layers. A wrong row, layer or padding leak is off by the order of the values themselves.
    got, expected = got.float(), expected.float()
    rms = expected.pow(2).mean().sqrt()
    assert (got - expected).abs().max() / rms < 0.15
    assert (got - expected).abs().mean() / rms < 0.01


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_states_equal_a_plain_cuda_forward(family, dtype, tiny_model_factory, kv_config):
    model_dir = tiny_model_factory(family)
    ref = load_reference(model_dir, dtype=getattr(torch, dtype), device="cuda")
    llm = LLM(model=model_dir, speculative_config=spec_config(ORDERED), dtype=dtype, device="cuda",
              kv_transfer_config=kv_config(), max_num_batched_tokens=64)  # several batches, chunked prefill
    prompts = mixed_prompts(7, seed=11)
    outs = llm.generate(prompts, SamplingParams(max_tokens=0))
    llm.shutdown()
    assert [o.error for o in outs] == [None] * len(prompts)
    for out in outs:
        path = out.kv_transfer_params["hidden_states_path"]
        obj = load_hidden_states(path)
        assert obj["hidden_states"].dtype == getattr(torch, dtype)
        assert read_hidden_states_info(path).metadata["dtype"] == dtype
        assert_close_for(dtype, obj["hidden_states"], reference_states(ref, out.prompt_token_ids, ORDERED))


def test_cuda_generation_with_output_tokens_matches_a_plain_forward_of_the_whole_sequence(tiny_model_factory,
                                                                                          kv_config):
    model_dir = tiny_model_factory("llama")
    ref = load_reference(model_dir, device="cuda")
    llm = LLM(model=model_dir, speculative_config=spec_config(ORDERED), dtype="float32", device="cuda",
              kv_transfer_config=kv_config())
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"include_output_tokens": True}})
    outs = llm.generate(["The cat", "Store load batch worker cluster node disk"], params)
    llm.shutdown()
    model = ref[0]
    for out in outs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            hf = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=6, do_sample=False,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"))
        assert out.outputs[0].token_ids == hf[0, len(ids):].tolist()
        stored = load_hidden_states(out.kv_transfer_params["hidden_states_path"])
        sequence = ids + out.outputs[0].token_ids[:-1]  # the last output token is never fed back
        assert stored["token_ids"].tolist() == sequence
        assert_close_for("float32", stored["hidden_states"], reference_states(ref, sequence, ORDERED))


def test_cuda_fp8_converted_on_the_gpu_writes_the_host_paths_bytes(tiny_model_factory, tmp_path):
    """fp8 on the device (issue 46): on CUDA the runner casts and scales before the copy; the files must be byte for
    byte those of the host path (the same engine with the device conversion off)."""
    import safetensors.torch

    from connectors import KVTransferConfig

    model_dir = tiny_model_factory("llama")
    tensors = {}
    for where in ("device", "host"):
        llm = LLM(model=model_dir, speculative_config=spec_config(ORDERED), dtype="bfloat16", device="cuda",
                  max_num_batched_tokens=64, kv_transfer_config=KVTransferConfig(kv_connector_extra_config={
                      "shared_storage_path": str(tmp_path / where), "storage_dtype": "fp8"}))
        assert llm.runner.device_storage == ("float8_e4m3fn" if where == "device" else llm.runner.device_storage)
        if where == "host":
            llm.runner.device_storage = None
        outs = llm.generate(mixed_prompts(5, seed=3), [SamplingParams(max_tokens=0), SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True, extra_args={"kv_transfer_params": {
                "include_output_tokens": True}})] * 2 + [SamplingParams(max_tokens=3)])  # prompt and decode rows
        tensors[where] = [safetensors.torch.load_file(o.kv_transfer_params["hidden_states_path"]) for o in outs]
        llm.shutdown()
    for a, b in zip(tensors["device"], tensors["host"]):
        assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("gemma3_text", "sdpa"), ("exaone4", "sdpa"),
                                         ("qwen3_moe", "sdpa"), ("llama", "flash_attention_2")])
def test_cuda_packed_prefill_equals_a_plain_cuda_forward(family, attn, tiny_model_factory, kv_config, monkeypatch):
    """Packed prefill on CUDA (issue 46): bf16 sdpa layers run every prompt in one varlen flash-attention call
    (windows of 8 tokens in gemma3_text / exaone4, shorter than the prompts); flash attention reads the packed prompts
    from the restarting position ids itself (transformers' varlen path)."""
    import torch.nn.attention.varlen as varlen
    from transformers.utils import is_flash_attn_2_available

    if attn == "flash_attention_2" and not is_flash_attn_2_available():
        pytest.skip("flash-attn is not installed")
    calls = []
    original = varlen.varlen_attn

    def counting(*args, **kwargs):
        calls.append(kwargs.get("window_size"))
        return original(*args, **kwargs)

    monkeypatch.setattr(varlen, "varlen_attn", counting)
    model_dir = tiny_model_factory(family)
    ref = load_reference(model_dir, dtype=torch.bfloat16, device="cuda")
    llm = LLM(model=model_dir, speculative_config=spec_config(ORDERED), dtype="bfloat16", device="cuda",
              attn_implementation=attn, packing="on", kv_transfer_config=kv_config(), max_num_batched_tokens=256)
    assert llm.runner.packer is not None
    prompts = mixed_prompts(9, seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=0))
    llm.shutdown()
    assert [o.error for o in outs] == [None] * len(prompts)
    assert bool(calls) == (attn == "sdpa")
    if family in ("gemma3_text", "exaone4"):
        assert (7, 0) in calls and (-1, 0) in calls  # window 8: the query and its 7 predecessors
    for out in outs:
        obj = load_hidden_states(out.kv_transfer_params["hidden_states_path"])
        assert_close_for("bfloat16", obj["hidden_states"], reference_states(ref, out.prompt_token_ids, ORDERED))
