"""The engine's top-k target (`target="top_k:K"`): the K most likely next tokens and their log-probabilities, computed
from the last layer through the model's own final norm and lm_head, equal a plain transformers forward's logits
whatever the batching and chunking — for prompt rows and for generated rows alike — and layer N is not stored."""

from __future__ import annotations

import pytest
import torch

from connectors import load_hidden_states
from connectors.format import HIDDEN_STATES, TARGET_TOPK_IDS, TARGET_TOPK_LOGPROBS
from extractor import LLM, SamplingParams
from harness.specs import spec_config
from tests.extractor.oracle import load_reference, reference_log_probs, reference_states
from tests.extractor.test_oracle import mixed_prompts

K = 16
AUX = [0, 1, 3]


def assert_topk_matches(ids: torch.Tensor, logprobs: torch.Tensor, reference: torch.Tensor) -> None:
    """Stored [T, K] against the reference log-probabilities [T, V]: the same values, and the stored ids are the
    reference's top K (a tie at the K-th place may pick either token)."""
    top = reference.topk(ids.shape[1])
    torch.testing.assert_close(logprobs, top.values, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(reference.gather(-1, ids.long()), logprobs, rtol=1e-4, atol=1e-4)
    assert ids.dtype == torch.int32 and (ids.long() == top.indices).float().mean() > 0.99


@pytest.mark.parametrize("storage", ["model", "fp8"])
def test_topk_target_equals_a_plain_transformers_forward_whatever_the_chunking(tiny_llama, kv_config, storage):
    ref = load_reference(tiny_llama)
    prompts = mixed_prompts(5, seed=3)
    for budget in (24, 4096):  # chunked prefill of the long prompt, then one forward for all
        llm = LLM(model=tiny_llama, speculative_config=spec_config([*AUX, 4]), dtype="float32", target=f"top_k:{K}",
                  kv_transfer_config=kv_config(shared_storage_path=f"{tiny_llama}-topk-{storage}-{budget}",
                                               storage_dtype=storage),
                  max_num_batched_tokens=budget)
        assert llm.spec.layer_ids == tuple(AUX) and llm.spec.target == f"top_k:{K}"  # N is the target's, not stored
        outs = llm.generate(prompts, SamplingParams(max_tokens=0))
        llm.shutdown()
        assert [o.error for o in outs] == [None] * len(prompts)
        for out in outs:
            got = load_hidden_states(out.kv_transfer_params["hidden_states_path"], verify=True)
            ids = torch.tensor(out.prompt_token_ids)
            assert_topk_matches(got[TARGET_TOPK_IDS], got[TARGET_TOPK_LOGPROBS], reference_log_probs(ref, ids))
            expected = reference_states(ref, ids.tolist(), AUX)
            assert got[HIDDEN_STATES].shape == expected.shape == (len(ids), len(AUX), 64)
            tol = 0.04 if storage == "fp8" else 1e-4
            assert float((got[HIDDEN_STATES] - expected).norm() / expected.norm()) <= tol


def test_generated_rows_carry_the_top_k_of_the_step_that_read_them(tiny_llama, kv_config):
    ref = load_reference(tiny_llama)
    llm = LLM(model=tiny_llama, speculative_config=spec_config(AUX), dtype="float32", target=f"top_k:{K}",
              kv_transfer_config=kv_config())
    outs = llm.generate(["The quick dog jumps", "A cat"],
                        SamplingParams(max_tokens=6, temperature=0.0,
                                       extra_args={"kv_transfer_params": {"include_output_tokens": True}}))
    llm.shutdown()
    for out in outs:
        got = load_hidden_states(out.kv_transfer_params["hidden_states_path"])
        ids = got["token_ids"]
        assert len(ids) == len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
        assert_topk_matches(got[TARGET_TOPK_IDS], got[TARGET_TOPK_LOGPROBS], reference_log_probs(ref, ids))
        # greedy decoding: each generated token is the best of the row before it
        n = len(out.prompt_token_ids)
        assert got[TARGET_TOPK_IDS][n - 1:-1, 0].tolist() == ids[n:].tolist()


def test_a_topk_target_without_another_layer_or_past_the_vocabulary_is_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"target top_k:4 replaces layer 4 \(the last\) and layer_ids lists no other"):
        LLM(model=tiny_llama, speculative_config=spec_config([4]), target="top_k:4")
    with pytest.raises(ValueError, match=r"K=600 is more than .* vocabulary of 512 tokens; use K <= 512"):
        LLM(model=tiny_llama, speculative_config=spec_config(AUX), target="top_k:600")
    with pytest.raises(ValueError, match="target 'top_k:' is not a target; use 'states'"):
        LLM(model=tiny_llama, speculative_config=spec_config(AUX), target="top_k:")
    with pytest.raises(ValueError, match="a speculative engine writes no files"):
        LLM(model=tiny_llama, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, target="top_k:4")
