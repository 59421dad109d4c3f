"""DSpark: DFlash's block with every slot drafting, the Markov head (vanilla, gated, rnn) and the confidence head; its
loss against the formula written out here, the proposer's slot-by-slot correction against the training forward,
the confidence early stop, the speculators checkpoint (loaded by speculators' own DSparkDraftModel), bad inputs, and
lossless decoding in hsx's engine."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.drafters.helpers import family_setup, train_steps
from tests.drafters.helpers import packed_batch as _batch

LAYERS = (1, 2, 4)


def _setup(oracle_run, tiny_llama, **options):
    from drafters.dspark import DSparkDrafter

    return family_setup(oracle_run, tiny_llama, DSparkDrafter, block_size=4, markov_rank=16, **options)


@pytest.fixture(scope="module")
def trained_head(oracle_run, tiny_llama, tmp_path_factory):
    ds, target, drafter = _setup(oracle_run, tiny_llama)
    batch = _batch(ds, [0, 1, 2], max_tokens=256)
    losses, result = train_steps(drafter, target, batch, 16)
    folder = str(tmp_path_factory.mktemp("dspark-head"))
    drafter.eval().save_pretrained(folder, verifier=tiny_llama)
    return folder, drafter, losses, result, ds, target


def test_training_lowers_the_loss_and_every_slot_drafts(trained_head):
    _, drafter, losses, result, _, _ = trained_head
    assert losses[-1] < 0.8 * losses[0], losses
    assert len(result.counted) == 4 and all(int(n) > 0 for n in result.counted)  # slots 0..3 of blocks of 4
    assert drafter.embed_tokens.weight.grad is None and drafter.markov_head.markov_w1.weight.grad is not None


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_the_loss_equals_dsparks_objective_written_out(kind, oracle_run, tiny_llama):
    """For fixed anchors: logits_k = lm_head(norm h_k) + W2 g(W1[x_{a+k}], ...) (the Markov head by its published
    formula, per kind, over the module's named weights), p_k = softmax(target logits at a+k), w_k = exp(-k/4);
    loss = 0.1 CE + 0.9 TV + BCE(confidence, 1 - TV), each a w-weighted mean over trained slots."""
    ds, target, drafter = _setup(oracle_run, tiny_llama, markov_head_type=kind)
    batch = _batch(ds, [0, 1], max_tokens=128)
    torch.manual_seed(3)
    got = drafter.training_step(batch, target)
    torch.manual_seed(3)  # the same anchors
    ok = drafter._anchor_ok(batch)
    n = min(drafter.config.max_anchors, max(1, int(ok.sum(-1).max())))
    score = torch.rand(batch.input_ids.shape).masked_fill(~ok, 2.0)
    anchors = score.topk(n, dim=-1, largest=False).indices.sort(-1).values
    with torch.no_grad():
        out, labels, trained = drafter.anchored_blocks(batch, anchors, ok)
    mh, w1 = drafter.markov_head, drafter.markov_head.markov_w1.weight
    terms = []
    for r, i, k in trained.nonzero().tolist():
        a = int(anchors[r, i])
        assert int(labels[r, i, k]) == a + k + 1  # slot k drafts x_{a+k+1}
        hs = drafter.norm(out[r, i])  # [B, H] the block's slots
        prev = batch.input_ids[r, a:a + 4]  # teacher-forced: x_{a+j} before slot j
        state = torch.zeros(mh.rank)
        for j in range(k + 1):  # the rnn reads the block from its start
            e = w1[prev[j]]
            if kind == "vanilla":
                x = e
            elif kind == "gated":
                x = torch.sigmoid(mh.gate_proj.weight @ torch.cat([hs[j], e]) + mh.gate_proj.bias) * e
            else:
                g, c, o = (mh.joint_proj.weight @ torch.cat([state, e, hs[j]]) + mh.joint_proj.bias).chunk(3)
                x, state = torch.tanh(o), torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
        logits = hs[k] @ target.lm_head.float().T + mh.markov_w2.weight @ x
        q = torch.softmax(logits, -1)
        p = torch.softmax(target.logits(batch.layer(4)[r, a + k]).float(), -1)
        tv = 0.5 * (q - p).abs().sum()
        conf = drafter.confidence_head.proj.weight[0] @ torch.cat([hs[k], e]) + drafter.confidence_head.proj.bias[0]
        bce = F.binary_cross_entropy_with_logits(conf, (1 - tv).detach())
        terms.append((torch.exp(torch.tensor(-k / 4.0)), -(p * torch.log(q)).sum(), tv, bce))
    w = torch.stack([t[0] for t in terms])
    want = sum(c * (w * torch.stack([t[j] for t in terms])).sum() / w.sum() for c, j in ((0.1, 1), (0.9, 2), (1.0, 3)))
    torch.testing.assert_close(got.loss.detach(), want.detach(), atol=1e-4, rtol=1e-4)
    assert got.counted.tolist() == [int((trained[..., k]).sum()) for k in range(4)]


def _context(oracle_model, drafter):
    from drafters.base import DrafterBatch
    from harness.runs import pre_norm_hidden_states

    model, tokenizer = oracle_model
    ctx = tokenizer("the quick model reads a batch of hidden states")["input_ids"]
    states = pre_norm_hidden_states(model, torch.tensor(ctx[:-1]))
    aux = torch.stack([states[i] for i in drafter.aux_layer_ids], dim=1)  # [T, A, H] states of x_0..x_{T-1}
    t = len(ctx) - 1
    hidden = torch.cat([aux, torch.zeros(1, *aux.shape[1:])])[None]
    batch = DrafterBatch(torch.tensor([ctx]), hidden, torch.ones(1, t + 1, dtype=torch.bool),
                         torch.arange(t + 1)[None], torch.zeros(1, t + 1, dtype=torch.long),
                         tuple(drafter.aux_layer_ids))
    return ctx, aux, batch, t


def test_the_proposer_corrects_slot_by_slot_what_the_training_forward_teacher_forces(trained_head, engine_runner,
                                                                                     oracle_model):
    """Greedy drafts d_0..d_3 equal the training forward's block at anchor T with prev = [x_T, d_0, d_1, d_2]
    (each draft conditions the next); a sampled row's q is that same corrected distribution."""
    from drafters.dspark_proposer import DSparkProposer
    from extractor.sampling import SamplingParams, sampling_probs

    folder, drafter, _, _, _, _ = trained_head
    ctx, aux, batch, t = _context(oracle_model, drafter)
    proposer = DSparkProposer(folder, engine_runner, 4)
    proposer.start([ctx])
    proposer.observe([aux])
    drafts = proposer.propose([ctx], [4], [SamplingParams(temperature=0.0, max_tokens=8)], [None])[0].token_ids
    assert len(drafts) == 4
    with torch.no_grad():
        out, _, _ = drafter.anchored_blocks(batch, torch.tensor([[t]]))
        logits, _ = drafter.corrected(out[0, 0], torch.tensor([ctx[-1], *drafts[:3]]))
    assert logits.argmax(-1).tolist() == drafts
    params = SamplingParams(temperature=0.8, max_tokens=8)
    proposer.start([ctx])
    proposer.observe([aux])
    draft = proposer.propose([ctx], [4], [params], [torch.Generator().manual_seed(0)])[0]
    with torch.no_grad():
        logits, _ = drafter.corrected(out[0, 0], torch.tensor([ctx[-1], *draft.token_ids[:3]]))
    torch.testing.assert_close(draft.probs, torch.stack([sampling_probs(row, params) for row in logits]))


def test_the_confidence_threshold_cuts_a_block_before_its_first_unsure_slot(trained_head, engine_runner,
                                                                           oracle_model, tmp_path):
    from drafters.dspark_proposer import DSparkProposer
    from extractor.sampling import SamplingParams

    folder, drafter, _, _, _, _ = trained_head
    ctx, aux, batch, t = _context(oracle_model, drafter)
    with torch.no_grad():
        out, _, _ = drafter.anchored_blocks(batch, torch.tensor([[t]]))
    full = None
    for threshold in (0.0, 0.5, 0.999):
        doc = json.loads(open(f"{folder}/config.json").read())
        doc["hsx_dspark"]["confidence_threshold"] = threshold
        head = tmp_path / f"t{threshold}"
        head.mkdir()
        (head / "config.json").write_text(json.dumps(doc))
        (head / "model.safetensors").write_bytes(open(f"{folder}/model.safetensors", "rb").read())
        proposer = DSparkProposer(str(head), engine_runner, 4)
        proposer.start([ctx])
        proposer.observe([aux])
        drafts = proposer.propose([ctx], [4], [SamplingParams(temperature=0.0, max_tokens=8)], [None])[0].token_ids
        full = drafts if threshold == 0 else full
        with torch.no_grad():
            _, conf = drafter.corrected(out[0, 0], torch.tensor([ctx[-1], *full[:3]]))
        sure = [float(c) >= threshold for c in torch.sigmoid(conf)]
        keep = sure.index(False) if False in sure else 4
        assert drafts == full[:keep], (threshold, drafts, full, sure)
    assert len(full) == 4


def test_checkpoint_is_speculators_dspark_layout_and_loads_in_speculators(trained_head, tiny_llama):
    from safetensors import safe_open

    from drafters.dspark import DSparkDrafter
    from extractor.config import SpeculativeConfig, checkpoint_method, checkpoint_num_speculative_tokens

    folder, drafter, _, _, _, _ = trained_head
    doc = json.loads(open(f"{folder}/config.json").read())
    assert doc["speculators_model_type"] == "dspark" and doc["architectures"] == ["DSparkSpeculator"]
    assert (doc["block_size"], doc["sample_from_anchor"], doc["markov_rank"], doc["markov_head_type"]) == \
        (4, True, 16, "vanilla")
    assert doc["enable_confidence_head"] and doc["confidence_head_with_markov"]
    with safe_open(f"{folder}/model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert not any(n.startswith(("lm_head", "embed_tokens", "d2t", "t2d")) for n in names)
    assert checkpoint_method(folder) == "dspark" and checkpoint_num_speculative_tokens(folder) == 3
    assert SpeculativeConfig(method="dspark", model=folder, num_speculative_tokens=4).parallel_drafting
    back = DSparkDrafter.from_pretrained(folder)
    ours, theirs = drafter.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    try:
        from speculators.models.dspark import DSparkDraftModel
    except Exception as e:  # noqa: BLE001 - any import failure means: not installed here
        pytest.skip(f"speculators is not importable ({type(e).__name__}: {e}); .ci/run installs it")
    loaded = DSparkDraftModel.from_pretrained(folder).state_dict()
    written = {k for k in ours if not k.startswith("embed_tokens.")}
    assert written <= set(loaded)
    assert all(torch.equal(loaded[k].float(), ours[k].float()) for k in written)
    assert torch.equal(loaded["embed_tokens.weight"].float(), ours["embed_tokens.weight"])  # from the verifier


def test_bad_dspark_inputs_are_refused_in_one_line(trained_head, tiny_llama, tmp_path):
    from connectors import HiddenStatesSpec
    from connectors.run import RunSpec
    from drafters.dspark import DSparkConfig, DSparkDrafter
    from extractor import LLM
    from reference.tiny_models import build_tiny_model

    folder, _, _, _, _, target = trained_head
    full = RunSpec.from_file_spec(HiddenStatesSpec(layer_ids=LAYERS, num_hidden_layers=4, hidden_size=64,
                                                   dtype="float32"))
    with pytest.raises(ValueError, match="a DSpark block of 4 drafts at most 4"):
        DSparkDrafter.for_run(full, target, 5, block_size=4)
    for bad, message in (({"markov_head_type": "lstm"}, "markov_head_type"),
                         ({"markov_rank": 0}, "confidence_head_with_markov needs"),
                         ({"confidence_threshold": 1.0}, "confidence_threshold")):
        with pytest.raises(ValueError, match=message):
            DSparkConfig(**bad)
    other = build_tiny_model("llama", str(tmp_path / "other"), hidden_size=96)  # another target
    with pytest.raises(ValueError) as e:
        LLM(other, speculative_config={"method": "dspark", "model": folder, "num_speculative_tokens": 3})
    assert "another model" in str(e.value) or "trained for" in str(e.value)
    assert "\n" not in str(e.value)
    doc = json.loads(open(f"{folder}/config.json").read())  # speculators' default layers: sliding, causal block
    doc["transformer_layer_config"].update(layer_types=["sliding_attention"], use_sliding_window=True,
                                           sliding_window=2048)
    doc["sliding_window_non_causal"] = False
    causal = tmp_path / "causal"
    causal.mkdir()
    (causal / "config.json").write_text(json.dumps(doc))
    (causal / "model.safetensors").write_bytes(open(f"{folder}/model.safetensors", "rb").read())
    with pytest.raises(ValueError, match="sliding windows with a causal block"):
        DSparkDrafter.from_pretrained(str(causal))
    with pytest.raises(ValueError, match="drafts 1 to 4 tokens per step"):
        LLM(tiny_llama, speculative_config={"method": "dspark", "model": folder, "num_speculative_tokens": 5})


@pytest.mark.slow
def test_engine_decoding_with_a_dspark_head_is_lossless_with_rows_joining(tiny_llama, oracle_model, tmp_path):
    """A head trained by `hsx train-drafter --kind dspark` (blocks of 4) on the target's own greedy continuations,
    its method and k read from the checkpoint: output equals transformers generate token for token, drafts
    accepted; the same with the confidence early stop on."""
    from tests.drafters.helpers import decode_like_generate, greedy_run
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    refs = greedy_run(oracle_model, tiny_llama, str(tmp_path / "run"), LAYERS)
    head = str(tmp_path / "head")
    train_drafter(TrainDrafterConfig(kind="dspark", run=str(tmp_path / "run"), model=tiny_llama, out=head, steps=60,
                                     lr=1e-2, batch_tokens=128, max_grad_norm=1.0, device="cpu", progress=False,
                                     family_options={"block_size": 4, "markov_rank": 32}))
    metrics = decode_like_generate(tiny_llama, {"model": head}, refs, min_accepted_per_draft=1.0)
    assert len(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values) == 4  # k = block_size
    doc = json.loads(open(f"{head}/config.json").read())
    doc["hsx_dspark"]["confidence_threshold"] = 0.3
    open(f"{head}/config.json", "w").write(json.dumps(doc))
    decode_like_generate(tiny_llama, {"model": head}, refs, min_accepted_per_draft=0.5)
