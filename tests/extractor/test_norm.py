"""FinalNorm computes with transformers' own norm module, loaded with only the final norm's weights."""

from __future__ import annotations

import pytest
import torch

from extractor.norm import FinalNorm


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_final_norm_is_transformers_module_and_equals_the_models_own_norm_exactly(tiny_model_factory, family):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory(family)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    norm = FinalNorm.from_model_dir(model_dir)
    assert type(norm.module) is type(model.model.norm)  # e.g. LlamaRMSNorm, not a copy of its formula
    assert norm.module.variance_epsilon == model.model.norm.variance_epsilon
    x = torch.randn(2, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        expected = model.model.norm(x)
    assert torch.equal(norm(x), expected)
    assert not norm(x).requires_grad
    # in a run's dtype, as the engine would have run the model
    x16 = x.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(norm.to(torch.bfloat16)(x16), model.model.norm.to(torch.bfloat16)(x16))


def test_a_norm_of_another_width_is_refused(tiny_llama):
    norm = FinalNorm.from_model_dir(tiny_llama)
    with pytest.raises(ValueError, match="does not belong to this run"):
        norm(torch.zeros(3, norm.hidden_size + 1))
