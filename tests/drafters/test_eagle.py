"""EAGLE (vLLM's `eagle` method): features from the target's own forward, the training step, vLLM's checkpoint
layout, bad runs refused, and lossless decoding in hsx's engine against transformers generate."""

from __future__ import annotations

import json

import pytest
import torch

from tests.drafters.helpers import family_setup, train_steps
from tests.drafters.helpers import packed_batch as _batch


@pytest.fixture(scope="module")
def eagle_setup(oracle_run, tiny_llama):
    from drafters.eagle import EagleDrafter

    return family_setup(oracle_run, tiny_llama, EagleDrafter)




def test_features_are_the_targets_post_norm_last_layer(eagle_setup, oracle_model):
    """fuse(stored layer N, pre-norm) = the state transformers' own forward hands its lm_head (hidden_states[-1])."""
    from harness.runs import pre_norm_hidden_states

    _, _, drafter = eagle_setup
    model, tokenizer = oracle_model
    ids = torch.tensor(tokenizer("the river carries the data downstream")["input_ids"])
    with torch.no_grad():
        post = model(ids[None], output_hidden_states=True).hidden_states[-1][0]
    last = pre_norm_hidden_states(model, ids)[-1]
    torch.testing.assert_close(drafter.fuse(last[:, None]), post)
    assert drafter.aux_layer_ids == (4,)
    with torch.no_grad():
        torch.testing.assert_close(drafter.logits(post), model(ids[None]).logits[0])


def test_eagle_overfits_a_tiny_run_and_keeps_the_targets_parts_frozen(eagle_setup):
    from drafters.eagle import EagleDrafter

    ds, target, _ = eagle_setup
    torch.manual_seed(0)
    drafter = EagleDrafter.for_run(ds.run_info, target, 3)
    batch = _batch(ds, [0, 1])
    params = [p for p in drafter.parameters() if p.requires_grad]
    assert not any(p is drafter.embed_tokens.weight for p in params)
    assert not any(p is q for p in params for q in drafter.target_norm.parameters())
    losses, result = train_steps(drafter, target, batch, 10)
    assert losses[-1] < 0.7 * losses[0], losses
    assert torch.equal(drafter.embed_tokens.weight, target.embed_tokens)
    assert torch.equal(drafter.target_lm_head, target.lm_head)
    assert len(result.accuracy()) == 3 and all(n > 0 for n in result.counted)


def test_checkpoint_is_vllms_eagle_layout_and_reloads_bit_exact(eagle_setup, tiny_llama, tmp_path):
    from safetensors import safe_open

    from drafters.eagle import EagleDrafter
    from extractor.config import checkpoint_method

    ds, target, drafter = eagle_setup
    drafter.save_pretrained(str(tmp_path), verifier=tiny_llama)
    doc = json.loads((tmp_path / "config.json").read_text())
    assert doc["architectures"] == ["EagleLlamaForCausalLM"] and doc["model_type"] == "llama"
    assert doc["num_hidden_layers"] == 1 and doc["hidden_size"] == 64 and doc["vocab_size"] == 512
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    # the names vLLM's llama_eagle.py loads (it prefixes "model."): no layer-0 input norm, no final norm, no lm_head
    assert names == {"fc.weight", "embed_tokens.weight", "layers.0.post_attention_layernorm.weight",
                     *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                     *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
    assert checkpoint_method(str(tmp_path)) == "eagle"
    back = EagleDrafter.from_pretrained(str(tmp_path))
    ours, theirs = drafter.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with torch.no_grad():
        a, b = drafter.eval().training_step(_batch(ds, [0, 1]), target), back.training_step(_batch(ds, [0, 1]), target)
    assert torch.equal(a.loss, b.loss)


def test_the_proposer_reads_out_with_the_runners_own_lm_head(eagle_setup, tiny_llama, tmp_path):
    """The engine's EAGLE proposer takes the loaded target's lm_head (the very tensor, in its dtype: no second copy)
    and final norm: nothing is read from the target's folder, which is gone by the time the proposer loads."""
    import shutil

    from drafters.eagle_proposer import EagleProposer
    from extractor.config import EngineConfig
    from extractor.runner import ModelRunner

    _, target, drafter = eagle_setup
    folder = tmp_path / "target"
    shutil.copytree(tiny_llama, folder)
    head = str(tmp_path / "head")
    drafter.save_pretrained(head, verifier=str(folder))  # the verifier it records is gone too
    runner = ModelRunner(EngineConfig(model=str(folder), dtype="bfloat16", device="cpu"))
    shutil.rmtree(folder)
    proposer = EagleProposer(head, runner, 3)
    lm_head = runner.model.get_output_embeddings().weight
    assert proposer.drafter.target_lm_head.data_ptr() == lm_head.data_ptr()
    assert proposer.drafter.target_lm_head.dtype == torch.bfloat16
    torch.testing.assert_close(proposer.drafter.target_norm.weight, runner.model.model.norm.weight)
    torch.testing.assert_close(proposer.drafter.fc.weight, drafter.fc.weight.to(torch.bfloat16))


def test_a_run_without_the_last_layer_is_refused_before_training(tiny_llama, oracle_run, tmp_path):
    from connectors import HiddenStatesSpec
    from connectors.run import RunSpec
    from drafters.base import TargetHead
    from drafters.eagle import EagleDrafter
    from harness.runs import random_samples, write_run
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    target = TargetHead.from_model_dir(tiny_llama)
    aux_only = RunSpec.from_file_spec(HiddenStatesSpec(layer_ids=(1, 2), num_hidden_layers=4, hidden_size=64,
                                                       dtype="float32"))
    with pytest.raises(ValueError, match=r"last layer \(id 4\)"):
        EagleDrafter.for_run(aux_only, target, 3)
    spec = HiddenStatesSpec(layer_ids=(1, 2), num_hidden_layers=4, hidden_size=64, dtype="float32", model=tiny_llama)
    write_run(str(tmp_path / "run"), random_samples(3, spec), spec)
    with pytest.raises(ValueError, match=r"--kind eagle needs layers \[4\]"):
        train_drafter(TrainDrafterConfig(kind="eagle", run=str(tmp_path / "run"), model=tiny_llama,
                                         out=str(tmp_path / "out"), steps=1, progress=False))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_engine_decoding_with_an_eagle_head_is_lossless_with_rows_joining(tiny_llama, oracle_model, tmp_path, capsys):
    """A head trained by `hsx train-drafter --kind eagle` on the target's own greedy continuations, served by
    LLM(speculative_config={"method": "eagle", ...}) two rows at a time (the third joins as one finishes): the
    output equals transformers generate token for token and the drafts are mostly accepted (only if the engine hands
    the head the last layer's states of the right tokens); the method is also read from the checkpoint; the seed's
    loop (examples/spec_decode.py --method eagle) prints vLLM's lines on it."""
    from tests.drafters.helpers import decode_like_generate, greedy_run, spec_decode_example
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    refs = greedy_run(oracle_model, tiny_llama, str(tmp_path / "run"), (4,))
    head = str(tmp_path / "head")
    train_drafter(TrainDrafterConfig(kind="eagle", run=str(tmp_path / "run"), model=tiny_llama, out=head, steps=40,
                                     lr=1e-2, batch_tokens=128, max_grad_norm=1.0, device="cpu", progress=False))
    for config in ({"method": "eagle", "model": head, "num_speculative_tokens": 3},
                   {"model": head, "num_speculative_tokens": 3}):  # the method read from the checkpoint
        decode_like_generate(tiny_llama, config, refs, min_accepted_per_draft=1.0)
    capsys.readouterr()
    al = spec_decode_example().main(["--method", "eagle", "--model", tiny_llama, "--draft-model", head,
                                     "--num-prompts", "3", "--output-len", "8"])
    printed = capsys.readouterr().out
    assert al >= 1.0 and "mean acceptance length:" in printed and "acceptance at token 2:" in printed
