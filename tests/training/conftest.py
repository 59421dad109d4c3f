"""Fixtures for the training-feed tests: runs built through the real connector, and an oracle run from a plain
transformers forward of the tiny Llama."""

from __future__ import annotations

import pytest
import torch

from connectors import HiddenStatesSpec
from tests.training.runs import oracle_samples, random_samples, write_run

# 4-layer tiny model: ids 1, 2 (aux) and 4 = N, the last decoder layer, stored pre-norm
ORACLE_LAYERS = (1, 2, 4)


@pytest.fixture(scope="session")
def random_run(tmp_path_factory):
    """(output, samples, spec): 12 random bf16 samples, 3 layers of width 16, manifest in two parts."""
    spec = HiddenStatesSpec(layer_ids=(2, 3, 6), num_hidden_layers=6, hidden_size=16, dtype="bfloat16",
                            model="tiny/random")
    samples = random_samples(12, spec, seed=1)
    out = str(tmp_path_factory.mktemp("random-run"))
    write_run(out, samples, spec, manifest_parts=2)
    return out, samples, spec


@pytest.fixture(scope="session")
def oracle_model(tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="session")
def oracle_run(tmp_path_factory, tiny_llama, oracle_model):
    """(output, samples, spec): texts through the tiny Llama, layers ORACLE_LAYERS, last one pre-norm."""
    from jobs.tiny_models import sample_text

    model, tokenizer = oracle_model
    spec = HiddenStatesSpec(layer_ids=ORACLE_LAYERS, num_hidden_layers=model.config.num_hidden_layers,
                            hidden_size=model.config.hidden_size, dtype="float32", model=tiny_llama)
    samples = oracle_samples(model, sample_text(6, seed=7, min_words=4, max_words=30), tokenizer, ORACLE_LAYERS)
    out = str(tmp_path_factory.mktemp("oracle-run"))
    write_run(out, samples, spec)
    return out, samples, spec
