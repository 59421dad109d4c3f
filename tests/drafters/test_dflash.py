"""DFlash: a block of drafts from one forward, the decoding path against the training forward, the speculators
checkpoint (loaded by speculators' own DFlashDraftModel where it is installed), bad runs refused, and lossless
decoding in hsx's engine against transformers generate."""

from __future__ import annotations

import json

import pytest
import torch

from tests.drafters.helpers import family_setup, train_steps
from tests.drafters.helpers import packed_batch as _batch

LAYERS = (1, 2, 4)


@pytest.fixture(scope="module")
def dflash_setup(oracle_run, tiny_llama):
    from drafters.dflash import DFlashDrafter

    return family_setup(oracle_run, tiny_llama, DFlashDrafter, block_size=4)




@pytest.fixture(scope="module")
def trained_head(dflash_setup, tiny_llama, tmp_path_factory):
    ds, target, drafter = dflash_setup
    batch = _batch(ds, [0, 1, 2], max_tokens=256)
    losses, result = train_steps(drafter, target, batch, 16)
    folder = str(tmp_path_factory.mktemp("dflash-head"))
    drafter.eval().save_pretrained(folder, verifier=tiny_llama)
    return folder, drafter, losses, result


def test_training_lowers_the_loss_over_every_slot(trained_head):
    _, drafter, losses, result = trained_head
    assert losses[-1] < 0.8 * losses[0], losses
    assert len(result.counted) == 3 and all(int(n) > 0 for n in result.counted)  # slots 1..3 of blocks of 4
    assert drafter.embed_tokens.weight.grad is None


def test_one_forward_drafts_the_block_the_training_forward_predicts(trained_head, engine_runner, oracle_model):
    """The proposer (cached context keys, one forward per step) drafts what the training forward's block at anchor T
    predicts: the same attention (context before the anchor, the block both ways), the same positions."""
    from drafters.base import DrafterBatch
    from drafters.dflash_proposer import DFlashProposer
    from extractor.sampling import SamplingParams, sampling_probs
    from harness.runs import pre_norm_hidden_states

    folder, drafter, _, _ = trained_head
    model, tokenizer = oracle_model
    ctx = tokenizer("the quick model reads a batch of hidden states")["input_ids"]
    states = pre_norm_hidden_states(model, torch.tensor(ctx[:-1]))
    aux = torch.stack([states[i] for i in LAYERS[:2]], dim=1)  # [T, 2, H] = states of x_0..x_{T-1}
    proposer = DFlashProposer(folder, engine_runner, 3)
    calls, blocks = [], proposer.drafter.blocks
    proposer.drafter.blocks = lambda *a: calls.append(tuple(a[0].shape)) or blocks(*a)
    proposer.start([ctx])
    proposer.observe([aux[:4]])  # the context arrives in pieces, as verification hands it over
    proposer.observe([aux[4:]])
    drafts = proposer.propose([ctx], [3], [SamplingParams(temperature=0.0, max_tokens=8)], [None])[0].token_ids
    assert len(drafts) == 3 and calls == [(1, 4)]

    # the oracle: training's own block forward (its anchors, positions and mask) at anchor T over x_0..x_T
    t = len(ctx) - 1
    stored = torch.stack([states[i] for i in drafter.aux_layer_ids], dim=1)  # [T, A, H]
    hidden = torch.cat([stored, torch.zeros(1, *stored.shape[1:])])[None]  # x_T's own states are never read
    batch = DrafterBatch(torch.tensor([ctx]), hidden, torch.ones(1, t + 1, dtype=torch.bool),
                         torch.arange(t + 1)[None], torch.zeros(1, t + 1, dtype=torch.long),
                         tuple(drafter.aux_layer_ids))
    with torch.no_grad():
        out, _, _ = drafter.anchored_blocks(batch, torch.tensor([[t]]))
        logits = drafter.logits(out[0, 0, 1:])  # [3, V] slots 1..3
    assert logits.argmax(-1).tolist() == drafts

    # a sampled row: each slot's q is the request's distribution over that slot's logits (one forward: the slots do
    # not depend on each other's draws), and every draft is a token q gives mass to
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=8)
    proposer.start([ctx])
    proposer.observe([aux])
    draft = proposer.propose([ctx], [3], [params], [torch.Generator().manual_seed(0)])[0]
    want = torch.stack([sampling_probs(row, params) for row in logits])
    torch.testing.assert_close(draft.probs, want)
    assert all(float(want[j, tok]) > 0 for j, tok in enumerate(draft.token_ids))


def test_the_proposer_shares_the_runners_embeddings_and_lm_head(trained_head, tiny_llama, tmp_path):
    """The engine's DFlash proposer reads out with the loaded target's own embeddings and lm_head (the very tensors,
    in its dtype: no second copy on the device) and reads nothing from the target's folder, gone by then."""
    import shutil

    from safetensors.torch import load_file, save_file

    from drafters.dflash_proposer import DFlashProposer
    from extractor.config import EngineConfig
    from extractor.runner import ModelRunner

    _, drafter, _, _ = trained_head
    folder = tmp_path / "target"
    shutil.copytree(tiny_llama, folder)
    head = tmp_path / "head"
    drafter.save_pretrained(str(head), verifier=str(folder))  # the verifier it records is gone too
    # a checkpoint from another tool that carries embeddings of its own: they never overwrite the target's
    state = load_file(head / "model.safetensors")
    state["embed_tokens.weight"] = torch.full((512, 64), 7.0)
    save_file(state, head / "model.safetensors")
    runner = ModelRunner(EngineConfig(model=str(folder), dtype="bfloat16", device="cpu"))
    shutil.rmtree(folder)
    embeddings = runner.model.get_input_embeddings().weight.clone()
    proposer = DFlashProposer(str(head), runner, 3)
    assert torch.equal(runner.model.get_input_embeddings().weight, embeddings)
    assert proposer.drafter.target_lm_head.data_ptr() == runner.model.get_output_embeddings().weight.data_ptr()
    assert proposer.drafter.embed_tokens.weight.data_ptr() == runner.model.get_input_embeddings().weight.data_ptr()
    assert proposer.drafter.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(proposer.drafter.fc.weight, drafter.fc.weight.to(torch.bfloat16))


def test_checkpoint_is_speculators_dflash_layout(trained_head, tiny_llama):
    from safetensors import safe_open

    from drafters.dflash import DFlashDrafter
    from extractor.config import checkpoint_method, checkpoint_num_speculative_tokens

    folder, drafter, _, _ = trained_head
    doc = json.loads(open(f"{folder}/config.json").read())
    assert doc["speculators_model_type"] == "dflash" and doc["architectures"] == ["DFlashSpeculator"]
    assert (doc["block_size"], doc["sample_from_anchor"], doc["aux_hidden_state_layer_ids"]) == (4, False, [1, 2])
    assert doc["transformer_layer_config"]["model_type"] == "qwen3" and doc["draft_vocab_size"] == 512
    assert doc["mask_token_id"] == drafter.mask_token_id
    with safe_open(f"{folder}/model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.0.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight",
            "layers.0.input_layernorm.weight"} <= names
    assert not any(n.startswith(("lm_head", "embed_tokens", "d2t", "t2d")) for n in names)  # whole vocabulary
    assert checkpoint_method(folder) == "dflash" and checkpoint_num_speculative_tokens(folder) == 3
    from extractor.config import SpeculativeConfig

    # a block drafter drafts in parallel by nature: vLLM's parallel_drafting flag is accepted, and implied
    assert SpeculativeConfig(method="dflash", model=folder, num_speculative_tokens=3, parallel_drafting=True
                             ).parallel_drafting
    assert SpeculativeConfig(method="dflash", model=folder, num_speculative_tokens=2).parallel_drafting
    back = DFlashDrafter.from_pretrained(folder)
    ours, theirs = drafter.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_speculators_own_class_loads_every_weight(trained_head):
    try:
        from speculators.models.dflash import DFlashDraftModel
    except Exception as e:  # noqa: BLE001 - any import failure means: not installed here
        pytest.skip(f"speculators is not importable ({type(e).__name__}: {e}); .ci/run installs it "
                    "(constraints/peers.txt)")
    folder, drafter, _, _ = trained_head
    theirs = DFlashDraftModel.from_pretrained(folder).state_dict()
    ours = drafter.state_dict()
    written = {k for k in ours if not k.startswith("embed_tokens.")}
    assert written <= set(theirs)
    assert all(torch.equal(theirs[k].float(), ours[k].float()) for k in written)
    assert torch.equal(theirs["embed_tokens.weight"].float(), ours["embed_tokens.weight"])  # from the verifier


def test_bad_runs_are_refused_naming_the_layers(tiny_llama):
    from connectors import HiddenStatesSpec
    from connectors.run import RunSpec
    from drafters.base import TargetHead
    from drafters.dflash import DFlashDrafter

    target = TargetHead.from_model_dir(tiny_llama)
    only_last = RunSpec.from_file_spec(HiddenStatesSpec(layer_ids=(4,), num_hidden_layers=4, hidden_size=64,
                                                        dtype="float32"))
    with pytest.raises(ValueError, match=r"stores only layers \[4\]"):
        DFlashDrafter.for_run(only_last, target, 3)
    with pytest.raises(ValueError, match=r"missing \[3\]"):
        DFlashDrafter.for_run(only_last, target, 3, aux_layer_ids=(3,))
    aux_only = RunSpec.from_file_spec(HiddenStatesSpec(layer_ids=(1, 2), num_hidden_layers=4, hidden_size=64,
                                                       dtype="float32"))
    with pytest.raises(ValueError, match=r"missing \[4\]"):
        DFlashDrafter.for_run(aux_only, target, 3)
    full = RunSpec.from_file_spec(HiddenStatesSpec(layer_ids=LAYERS, num_hidden_layers=4, hidden_size=64,
                                                   dtype="float32"))
    with pytest.raises(ValueError, match="a DFlash block of 4 drafts at most 3"):
        DFlashDrafter.for_run(full, target, 5, block_size=4)


@pytest.mark.slow
def test_engine_decoding_with_a_dflash_head_is_lossless_with_rows_joining(tiny_llama, oracle_model, tmp_path):
    """A head trained by `hsx train-drafter --kind dflash` (blocks of 4) on the target's own greedy continuations,
    its method and k read from the checkpoint, two rows at a time (the third joins): output equals transformers
    generate token for token, its drafts accepted, k = block_size - 1."""
    from tests.drafters.helpers import decode_like_generate, greedy_run
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    refs = greedy_run(oracle_model, tiny_llama, str(tmp_path / "run"), LAYERS)
    head = str(tmp_path / "head")
    train_drafter(TrainDrafterConfig(kind="dflash", run=str(tmp_path / "run"), model=tiny_llama, out=head, steps=60,
                                     lr=1e-2, batch_tokens=128, max_grad_norm=1.0, device="cpu", progress=False,
                                     family_options={"block_size": 4}))
    metrics = decode_like_generate(tiny_llama, {"model": head}, refs, min_accepted_per_draft=1.0)
    # no --num-speculative-tokens: the checkpoint says k = block_size - 1, which the engine takes
    assert len(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values) == 3
