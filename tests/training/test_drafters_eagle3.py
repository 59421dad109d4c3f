"""EAGLE-3 drafter: the draft vocabulary, the model and its training step, the speculators checkpoint, the proposer."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from training.drafters.vocab import DraftVocab, build_draft_vocab, count_tokens

# -- draft vocabulary -----------------------------------------------------------------------------------------------


def test_draft_vocab_is_the_most_frequent_loss_masked_tokens_by_hand_count():
    items = [{"input_ids": torch.tensor([5, 5, 7, 9, 9, 9, 3, 1]), "loss_mask": torch.tensor([1, 1, 1, 1, 1, 0, 0, 1])},
             {"input_ids": torch.tensor([7, 2, 2, 8]), "loss_mask": torch.tensor([1, 1, 0, 1])}]
    hand = Counter()
    for item in items:
        for t, m in zip(item["input_ids"].tolist(), item["loss_mask"].tolist()):
            if m:
                hand[t] += 1
    assert count_tokens(items, 12).tolist() == [hand[i] for i in range(12)]
    # counts: 5:2 7:2 9:2 1:1 2:1 8:1 -> top 4 = 5, 7, 9 and the lowest id among the ones (1)
    vocab = build_draft_vocab(items, 12, 4)
    assert vocab.draft_to_target.tolist() == [1, 5, 7, 9]
    d2t, t2d = vocab.d2t, vocab.t2d
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (12,)
    assert [i + int(d2t[i]) for i in range(4)] == [1, 5, 7, 9]
    assert [i for i in range(12) if t2d[i]] == [1, 5, 7, 9]
    assert torch.equal(DraftVocab.from_maps(d2t, t2d).draft_to_target, vocab.draft_to_target)


def test_draft_vocab_fills_with_unseen_ids_in_order_and_covers_whole_vocab_when_large():
    items = [{"input_ids": torch.tensor([6, 6, 4]), "loss_mask": torch.tensor([1, 1, 1])}]
    assert build_draft_vocab(items, 8, 4).draft_to_target.tolist() == [0, 1, 4, 6]
    whole = build_draft_vocab(items, 8, 100)
    assert whole.is_identity and whole.d2t.eq(0).all() and whole.t2d.all()


def test_tokens_outside_the_target_vocabulary_are_refused():
    with pytest.raises(ValueError, match="outside the target's vocabulary of 8"):
        count_tokens([{"input_ids": torch.tensor([3, 9]), "loss_mask": torch.tensor([1, 1])}], 8)


def test_inconsistent_maps_are_refused():
    vocab = DraftVocab(torch.tensor([1, 3]), 5)
    t2d = vocab.t2d.clone()
    t2d[0] = True
    with pytest.raises(ValueError, match="disagree"):
        DraftVocab.from_maps(vocab.d2t, t2d)


# -- the model and its training step --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eagle3_setup(oracle_run, tiny_llama):
    """(dataset, target head, a fresh drafter with a 48-token draft vocabulary built from the run)."""
    from training import HiddenStatesDataset
    from training.drafters.base import TargetHead
    from training.drafters.eagle3 import Eagle3Drafter

    output, _, _ = oracle_run
    ds = HiddenStatesDataset(output)
    target = TargetHead.from_model_dir(tiny_llama)
    torch.manual_seed(0)
    drafter = Eagle3Drafter.for_run(ds.run_info, target, 3, draft_vocab_size=48)
    drafter.prepare(ds)
    return ds, target, drafter


def _batch(ds, indices, max_tokens=128):
    from training import PackCollator
    from training.drafters.base import DrafterBatch

    return DrafterBatch.from_packed(PackCollator(max_tokens)([ds[i] for i in indices]), ds.run_info.layer_ids)


def _fresh(setup, **options):
    from training.drafters.eagle3 import Eagle3Drafter

    ds, target, drafter = setup
    torch.manual_seed(0)
    fresh = Eagle3Drafter.for_run(ds.run_info, target, 3, draft_vocab_size=48, **options)
    fresh.set_vocab(DraftVocab.from_maps(drafter.d2t, drafter.t2d))
    return fresh


def test_draft_vocab_of_the_drafter_is_the_runs_most_frequent_trained_tokens(eagle3_setup):
    ds, _, drafter = eagle3_setup
    hand = Counter()
    for s in (ds[i] for i in range(len(ds))):
        hand.update(t for t, m in zip(s["input_ids"].tolist(), s["loss_mask"].tolist()) if m)
    ranked = sorted(range(512), key=lambda t: (-hand[t], t))[:48]
    assert drafter.draft_ids.tolist() == sorted(ranked)
    assert drafter.lm_head.weight.shape == (48, 64) and drafter.fc.weight.shape == (64, 2 * 64)
    assert drafter.layers[0].self_attn.q_proj.weight.shape[1] == 2 * 64
    assert drafter.aux_layer_ids == (1, 2)


def test_step_zero_loss_is_cross_entropy_against_the_targets_own_next_token_distribution(eagle3_setup, oracle_model):
    """Oracle: the teacher from a plain transformers forward of the target (its logits at t+1 for x_{t+2}), the
    student's logits from the drafter's own layers on one unpacked sample with a plain causal mask."""
    import torch.nn.functional as F
    from transformers import DynamicCache

    ds, target, _ = eagle3_setup
    drafter = _fresh(eagle3_setup, ttt_steps=1)
    model, _ = oracle_model
    item = ds[1]
    ids, mask, states = item["input_ids"], item["loss_mask"].bool(), item["hidden_states"]  # [T], [T], [T, L, H]
    t = ids.shape[0]
    with torch.no_grad():
        result = drafter.training_step(_batch(ds, [1]), target)
        teacher = F.softmax(model(ids[None]).logits[0][:, drafter.draft_ids], -1)  # [T, D]
        fused = drafter.fc(states[:-1, :2].flatten(-2))[None]  # chains 0..T-2: aux of x_t
        causal = torch.ones(t - 1, t - 1, dtype=torch.bool).tril()[None, None]
        out = drafter.decode(ids[1:][None], fused, torch.arange(t - 1)[None], causal, DynamicCache())
        logp = F.log_softmax(drafter.logits(out)[0], -1)  # [T-1, D]: chain c predicts x_{c+2}
    chains = [c for c in range(t - 2) if mask[c + 2]]
    expected = torch.stack([-(teacher[c + 1] * logp[c]).sum() for c in chains]).mean()
    torch.testing.assert_close(result.loss, expected, rtol=1e-4, atol=1e-4)
    assert result.counted.tolist() == [len(chains)]
    greedy = model(ids[None]).logits[0].argmax(-1)
    hits = sum(int(drafter.draft_ids[logp[c].argmax()] == greedy[c + 1]) for c in chains)
    assert result.correct.tolist() == [hits]


def test_packed_rows_never_pair_across_documents(eagle3_setup):
    """Every step's loss sum over a packed row equals the sum over the samples trained alone."""
    ds, target, _ = eagle3_setup
    drafter = _fresh(eagle3_setup, ttt_steps=3, step_loss_decay=0.5)
    with torch.no_grad():
        packed = drafter.training_step(_batch(ds, [0, 1, 2], max_tokens=256), target)
        alone = [drafter.training_step(_batch(ds, [i]), target) for i in (0, 1, 2)]
    assert packed.counted.tolist() == [sum(int(r.counted[s]) for r in alone) for s in range(3)]
    assert packed.correct.tolist() == [sum(int(r.correct[s]) for r in alone) for s in range(3)]
    # the loss is a per-step mean: compare decay-weighted sums of per-step means back to sums via a one-step model
    one = _fresh(eagle3_setup, ttt_steps=1)
    with torch.no_grad():
        packed1 = one.training_step(_batch(ds, [0, 1, 2], max_tokens=256), target)
        alone1 = [one.training_step(_batch(ds, [i]), target) for i in (0, 1, 2)]
    total = sum(float(r.loss) * int(r.counted[0]) for r in alone1)
    assert float(packed1.loss) * int(packed1.counted[0]) == pytest.approx(total, rel=1e-4)


def test_eagle3_overfits_a_tiny_run(eagle3_setup):
    ds, target, _ = eagle3_setup
    drafter = _fresh(eagle3_setup)
    batch = _batch(ds, [0, 1, 2, 3], max_tokens=256)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(12):
        result = drafter.training_step(batch, target)
        opt.zero_grad()
        result.loss.backward()
        opt.step()
        losses.append(result.loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert drafter.embed_tokens.weight.grad is None  # the target's embeddings stay frozen
    assert torch.equal(drafter.embed_tokens.weight, target.embed_tokens)
    assert len(result.accuracy()) == 3 and result.simulated_acceptance_length() >= 1.0


# -- checkpoint -----------------------------------------------------------------------------------------------------


def test_checkpoint_is_the_speculators_layout_and_reloads_bit_exact(eagle3_setup, tiny_llama, tmp_path):
    import json

    from safetensors import safe_open

    from training.drafters.eagle3 import Eagle3Drafter

    ds, target, drafter = eagle3_setup
    drafter.save_pretrained(str(tmp_path), verifier=tiny_llama)
    doc = json.loads((tmp_path / "config.json").read_text())
    assert doc["speculators_model_type"] == "eagle3" and doc["architectures"] == ["Eagle3Speculator"]
    assert doc["draft_vocab_size"] == 48 and doc["target_hidden_size"] == 64 and doc["norm_before_residual"] is False
    assert doc["eagle_aux_hidden_state_layer_ids"] == [1, 2]
    layer = doc["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["vocab_size"] == 512 and layer["num_hidden_layers"] == 1
    assert doc["speculators_config"]["verifier"]["name_or_path"] == tiny_llama
    assert doc["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
            "layers.0.self_attn.q_proj.weight", "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
            "layers.0.mlp.down_proj.weight"} <= names
    assert all(n.split(".")[0] in {"fc", "layers", "norm", "lm_head", "d2t", "t2d", "embed_tokens"} for n in names)

    back = Eagle3Drafter.from_pretrained(str(tmp_path))
    ours, theirs = drafter.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    batch = _batch(ds, [0, 1])
    drafter.eval()
    with torch.no_grad():
        a, b = drafter.training_step(batch, target), back.training_step(batch, target)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.correct, b.correct)
    assert back.config == drafter.config.__class__(**{**drafter.config.__dict__, "init_lm_head_from_target": False})


def test_a_whole_vocabulary_head_omits_the_maps_and_reloads(eagle3_setup, tiny_llama, tmp_path):
    from safetensors import safe_open

    from training.drafters.eagle3 import Eagle3Drafter

    ds, target, _ = eagle3_setup
    whole = Eagle3Drafter.for_run(ds.run_info, target, 3, draft_vocab_size=10**6, ttt_steps=2)
    whole.prepare(ds)
    assert whole.lm_head.out_features == 512 and torch.equal(whole.lm_head.weight, target.lm_head)
    whole.save_pretrained(str(tmp_path), verifier=tiny_llama)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "d2t" not in f.keys() and "t2d" not in f.keys()
    back = Eagle3Drafter.from_pretrained(str(tmp_path))
    assert back.draft_ids.tolist() == list(range(512)) and back.config.ttt_steps == 2


def test_runs_without_aux_layers_are_refused_naming_the_layers(tiny_llama, tmp_path):
    from connectors import HiddenStatesSpec
    from connectors.run import RunSpec
    from training.drafters.base import TargetHead
    from training.drafters.eagle3 import Eagle3Drafter

    target = TargetHead.from_model_dir(tiny_llama)
    only_last = RunSpec.from_file_spec(HiddenStatesSpec(layer_ids=(4,), num_hidden_layers=4, hidden_size=64,
                                                        dtype="float32"))
    with pytest.raises(ValueError, match=r"stores only layers \[4\].*--layers 1,2,4"):
        Eagle3Drafter.for_run(only_last, target, 3)
    with pytest.raises(ValueError, match=r"missing \[3\]"):
        Eagle3Drafter.for_run(only_last, target, 3, aux_layer_ids=(3,))
    with pytest.raises(TypeError):
        Eagle3Drafter.for_run(only_last, target, 3, no_such_option=1)
