"""One contract every registered drafter family passes (as fsspec's backends run one test suite): it declares what it
reads from a run once, its session head (conftest.family_head) trains, saves a checkpoint that only its own family
recognises and that reloads bit-exact, and its proposer, built through the registry for hsx's engine, captures the
layers the head reads and drafts deterministically from them. Each family's own tests check what is its alone
(checkpoint layouts, alignment against oracles, lossless decoding)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from drafters.features import run_fit
from drafters.registry import drafter_class, families, family_features, trainable_families

FAMILIES = trainable_families()  # mtp decodes with the target's own layers: tests/drafters/test_mtp.py


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_family_declares_what_it_reads_from_a_run_once(kind, oracle_dataset):
    cls, features = drafter_class(kind), family_features(kind)
    assert cls.features is features and families()[kind].features is features
    spec = oracle_dataset.run_info
    assert cls.required_layer_ids(4, None) == features.required_layer_ids(4) == (4,)
    assert run_fit(features, spec).ok
    assert set(features.extraction_layer_ids(4)) <= {*spec.layer_ids, 4}
    topk = type("TopK", (), {"layer_ids": (1, 2), "num_hidden_layers": 4, "target_top_k": 8})()
    assert run_fit(features, topk).top_k_refused == (not features.top_k)


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_family_trains_saves_a_checkpoint_only_it_recognises_and_reloads_it_bit_exact(kind, family_head):
    folder, drafter, result = family_head(kind)
    assert len(result.correct) == len(result.counted) >= 1 and all(int(n) > 0 for n in result.counted)
    assert math.isfinite(float(result.loss.detach()))
    with open(f"{folder}/config.json") as f:
        doc = json.load(f)
    assert [name for name, fam in families().items() if fam.matches(doc)] == [kind]
    assert families()[kind].num_speculative_tokens(doc) == 3
    back = drafter_class(kind).from_pretrained(folder)
    ours, theirs = drafter.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_familys_proposer_captures_the_layers_its_head_reads_and_drafts_deterministically(kind, family_head,
                                                                                            engine_runner,
                                                                                            oracle_model):
    from extractor.sampling import SamplingParams
    from harness.runs import pre_norm_hidden_states

    folder, drafter, _ = family_head(kind)
    model, tokenizer = oracle_model
    ctx = tokenizer("the quick model reads a batch of hidden states")["input_ids"]
    states = pre_norm_hidden_states(model, torch.tensor(ctx[:-1]))
    drafts = []
    for _ in range(2):
        proposer = families()[kind].proposer(folder, engine_runner, 3)
        assert proposer.capture_layer_ids == tuple(getattr(drafter, "aux_layer_ids", (4,)))
        proposer.start([ctx])
        proposer.observe([torch.stack([states[i] for i in proposer.capture_layer_ids], dim=1)])
        drafts.append(proposer.propose([ctx], [3], [SamplingParams(temperature=0.0, max_tokens=8)], [None])[0])
    assert 1 <= len(drafts[0].token_ids) <= 3 and drafts[0].token_ids == drafts[1].token_ids
    assert all(0 <= t < engine_runner.vocab_size for t in drafts[0].token_ids)
