"""P-EAGLE: one drafter forward drafts k tokens, the parallel path agrees with the training unroll, COD sampling,
the speculators checkpoint (loaded by speculators' own PEagleDraftModel where it is installed), parallel_drafting in
speculative_config, and lossless decoding in hsx's engine against transformers generate."""

from __future__ import annotations

import json

import pytest
import torch

from tests.drafters.helpers import family_setup, train_steps
from tests.drafters.helpers import packed_batch as _batch

LAYERS = (1, 2, 4)


@pytest.fixture(scope="module")
def peagle_setup(oracle_run, tiny_llama):
    from drafters.peagle import PEagleDrafter

    return family_setup(oracle_run, tiny_llama, PEagleDrafter, draft_vocab_size=48, ttt_steps=4)




@pytest.fixture(scope="module")
def trained_head(peagle_setup, tiny_llama, tmp_path_factory):
    ds, target, drafter = peagle_setup
    batch = _batch(ds, [0, 1, 2], max_tokens=256)
    losses, result = train_steps(drafter, target, batch, 6)
    folder = str(tmp_path_factory.mktemp("peagle-head"))
    drafter.eval().save_pretrained(folder, verifier=tiny_llama)
    return folder, drafter, losses


def test_training_lowers_the_loss_and_trains_mask_hidden(trained_head):
    _, drafter, losses = trained_head
    assert losses[-1] < losses[0], losses
    assert drafter.mask_hidden.requires_grad


def test_cod_keeps_nested_shrinking_fractions_of_chains(peagle_setup):
    _, _, drafter = peagle_setup
    valid = torch.ones(64, 256, dtype=torch.bool)
    kept = [drafter.trained_chains(valid, d) for d in range(6)]
    fractions = [float(k.float().mean()) for k in kept]
    want = [1.0] + [max(0.7 ** d, 0.2) for d in range(1, 6)]
    assert fractions == pytest.approx(want, abs=0.02)
    assert all(bool((kept[d] <= kept[d - 1]).all()) for d in range(1, 6))  # a chain kept at d is kept before


def test_one_forward_drafts_what_the_training_unroll_predicts(trained_head, engine_runner, oracle_model):
    """The proposer calls the drafter once per step (the verified entries and k-1 mask entries together), and its
    drafts are the unroll's: depth d of chain t = len(ctx) - 2."""
    from drafters.peagle_proposer import PEagleProposer
    from extractor.sampling import SamplingParams, sampling_probs
    from harness.runs import pre_norm_hidden_states

    folder, drafter, _ = trained_head
    model, tokenizer = oracle_model
    ctx = tokenizer("the quick model reads a batch of hidden states")["input_ids"]
    states = pre_norm_hidden_states(model, torch.tensor(ctx[:-1]))
    aux_ctx = torch.stack([states[i] for i in LAYERS[:2]], dim=1)  # [T-1, 2, H]
    proposer = PEagleProposer(folder, engine_runner, 4)
    calls, decode = [], proposer.drafter.decode
    proposer.drafter.decode = lambda tok, *a: calls.append(tuple(tok.shape)) or decode(tok, *a)
    proposer.start([ctx])
    proposer.observe([aux_ctx])
    drafts = proposer.propose([ctx], [4], [SamplingParams(temperature=0.0, max_tokens=8)], [None])[0].token_ids
    assert len(drafts) == 4 and len(calls) == 1 and calls[0] == (1, len(ctx) - 1 + 3)

    aux = torch.zeros(1, len(ctx) + 3, 2, 64)
    aux[0, :len(ctx) - 1] = aux_ctx
    seq = torch.tensor([ctx + [0, 0, 0]])  # what lies after x_T never reaches chain T-1's depths >= 1
    with torch.no_grad():
        outputs = drafter.unroll(aux, seq, torch.arange(seq.shape[1])[None], torch.zeros_like(seq), 4)
    chain = len(ctx) - 2
    assert [int(drafter.draft_ids[drafter.logits(outputs[d][0, chain]).argmax()]) for d in range(4)] == drafts

    # a sampled row: each depth's q is the request's distribution over that depth's logits in the whole vocabulary
    # (none outside the draft vocabulary; one forward, so no depth depends on another's draw), every draft has mass
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8)
    proposer.start([ctx])
    proposer.observe([aux_ctx])
    draft = proposer.propose([ctx], [4], [params], [torch.Generator().manual_seed(0)])[0]
    want = []
    with torch.no_grad():
        for d in range(4):
            full = torch.full((512,), float("-inf"))
            full[drafter.draft_ids] = drafter.logits(outputs[d][0, chain])
            want.append(sampling_probs(full, params))
    torch.testing.assert_close(draft.probs, torch.stack(want))
    assert all(float(want[d][tok]) > 0 for d, tok in enumerate(draft.token_ids))


def test_checkpoint_is_speculators_peagle_layout(trained_head, tiny_llama, peagle_setup):
    from safetensors import safe_open

    from drafters.peagle import PEagleDrafter

    folder, drafter, _ = trained_head
    doc = json.loads(open(f"{folder}/config.json").read())
    assert doc["speculators_model_type"] == "peagle" and doc["architectures"] == ["PEagleSpeculator"]
    assert doc["speculators_config"]["algorithm"] == "peagle" and doc["mask_token_id"] == drafter.mask_token_id
    assert doc["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert (doc["norm_before_fc"], doc["fc_norm"], doc["norm_output"]) == (False, False, False)
    with safe_open(f"{folder}/model.safetensors", framework="pt") as f:
        assert f.get_tensor("mask_hidden").shape == (1, 1, 2 * 64)
    back = PEagleDrafter.from_pretrained(folder)
    ours, theirs = drafter.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert back.mask_token_id == drafter.mask_token_id


def test_speculators_own_class_loads_every_weight(trained_head):
    """speculators' PEagleDraftModel.from_pretrained reads the checkpoint with every weight it has from the file
    (equal to ours, so none left uninitialised; mask_hidden included) and the verifier's from the target."""
    try:
        from speculators.models.peagle import PEagleDraftModel
    except Exception as e:  # noqa: BLE001 - an import that fails for any reason means: not installed here
        pytest.skip(f"speculators is not importable ({type(e).__name__}: {e}); .ci/run installs it "
                    "(constraints/peers.txt)")
    folder, drafter, _ = trained_head
    theirs = PEagleDraftModel.from_pretrained(folder).state_dict()
    ours = drafter.state_dict()
    loaded = {k for k in theirs if not k.startswith("verifier_")}
    assert loaded == set(ours)
    assert all(torch.equal(theirs[k].float(), ours[k].float()) for k in loaded)


def test_parallel_drafting_in_speculative_config(trained_head, tiny_llama, tmp_path, peagle_setup, engine_runner):
    from drafters.eagle3 import Eagle3Drafter
    from extractor.config import SpeculativeConfig, speculative_config_from_dict

    folder, _, _ = trained_head
    spec, _ = speculative_config_from_dict({"method": "eagle3", "model": folder, "num_speculative_tokens": 3,
                                            "parallel_drafting": True})
    assert (spec.method, spec.parallel_drafting) == ("peagle", True)  # vLLM's eagle3 + parallel_drafting
    assert SpeculativeConfig(method="peagle", model=folder, num_speculative_tokens=3).parallel_drafting
    with pytest.raises(ValueError, match="use method 'peagle' for it or add parallel_drafting: true"):
        SpeculativeConfig(method="eagle3", model=folder, num_speculative_tokens=3)
    ds, target, _ = peagle_setup
    plain = str(tmp_path / "eagle3")
    Eagle3Drafter.for_run(ds.run_info, target, 3, draft_vocab_size=48).save_pretrained(plain, verifier=tiny_llama)
    with pytest.raises(ValueError, match="not trained to draft in parallel.*--kind peagle"):
        speculative_config_from_dict({"method": "eagle3", "model": plain, "num_speculative_tokens": 3,
                                      "parallel_drafting": True})
    with pytest.raises(ValueError, match="parallel_drafting=True is not supported"):
        speculative_config_from_dict({"method": "ngram", "num_speculative_tokens": 3, "parallel_drafting": True})
    with pytest.raises(ValueError, match="parallel_drafting must be true or false, got 'false'"):
        SpeculativeConfig(method="eagle3", model=folder, num_speculative_tokens=3, parallel_drafting="false")
    from drafters.peagle_proposer import PEagleProposer

    with pytest.raises(ValueError, match="trained for 4 depths.*--ttt-steps 5"):
        PEagleProposer(folder, engine_runner, 5)


@pytest.mark.slow
def test_engine_decoding_with_a_peagle_head_is_lossless_with_rows_joining(tiny_llama, oracle_model, tmp_path, capsys):
    """A head trained by `hsx train-drafter --kind peagle` on the target's own greedy continuations, served with
    vLLM's eagle3 + parallel_drafting two rows at a time (the third joins): output equals transformers generate token
    for token, its drafts are accepted, and examples/spec_decode.py --parallel-drafting prints vLLM's lines on it."""
    from tests.drafters.helpers import decode_like_generate, greedy_run, spec_decode_example
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    refs = greedy_run(oracle_model, tiny_llama, str(tmp_path / "run"), LAYERS)
    head = str(tmp_path / "head")
    train_drafter(TrainDrafterConfig(kind="peagle", run=str(tmp_path / "run"), model=tiny_llama, out=head, steps=60,
                                     lr=1e-2, batch_tokens=128, draft_vocab_size=64, ttt_steps=4, max_grad_norm=1.0,
                                     device="cpu", progress=False))
    decode_like_generate(tiny_llama, {"method": "eagle3", "model": head, "num_speculative_tokens": 3,
                                      "parallel_drafting": True}, refs, min_accepted_per_draft=1.0)
    capsys.readouterr()
    spec_decode_example().main(["--method", "eagle3", "--parallel-drafting", "--model", tiny_llama, "--draft-model",
                                head, "--num-prompts", "3", "--output-len", "8"])
    printed = capsys.readouterr().out
    assert "mean acceptance length:" in printed and "acceptance at token 2:" in printed
