"""EAGLE-3 drafter: the draft vocabulary, the model and its training step, the speculators checkpoint, the proposer."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch

from drafters.vocab import DraftVocab, build_draft_vocab, count_tokens
from tests.drafters.helpers import family_setup
from tests.drafters.helpers import packed_batch as _batch

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
    from drafters.eagle3 import Eagle3Drafter

    return family_setup(oracle_run, tiny_llama, Eagle3Drafter, draft_vocab_size=48)


def _fresh(setup, **options):
    from drafters.eagle3 import Eagle3Drafter

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



def test_a_packed_row_keeps_every_chains_computation_of_its_documents(eagle3_setup):
    """The unroll over a packed row (documents kept apart by the ranged attention) equals the unroll over each
    document alone, position by position."""
    ds, _, drafter = eagle3_setup
    packed = _batch(ds, [0, 1, 2], max_tokens=256)
    assert packed.input_ids.shape[0] == 1 and int(packed.document_ids.max()) == 2

    def run(b):
        aux = torch.stack([b.layer(i) for i in drafter.aux_layer_ids], dim=2)
        with torch.no_grad():
            return drafter.unroll(aux, b.input_ids, b.position_ids, b.document_ids, 3)

    whole = run(packed)
    start = 0
    for i in (0, 1, 2):
        alone = run(_batch(ds, [i], max_tokens=256))
        n = ds[i]["input_ids"].shape[0]
        for s in range(3):  # chains whose inputs x_{t+1..t+1+s} lie in their document (the others are never trained)
            inside = n - 1 - s
            torch.testing.assert_close(whole[s][0, start:start + inside], alone[s][0, :inside], rtol=1e-4, atol=1e-5)
        start += n


def test_eagle3_overfits_a_tiny_run(eagle3_setup):
    ds, target, _ = eagle3_setup
    drafter = _fresh(eagle3_setup)
    batch = _batch(ds, [0, 1], max_tokens=128)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
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

    from drafters.eagle3 import Eagle3Drafter

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

    from drafters.eagle3 import Eagle3Drafter

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
    from drafters.base import TargetHead
    from drafters.eagle3 import Eagle3Drafter

    target = TargetHead.from_model_dir(tiny_llama)
    only_last = RunSpec.from_file_spec(HiddenStatesSpec(layer_ids=(4,), num_hidden_layers=4, hidden_size=64,
                                                        dtype="float32"))
    with pytest.raises(ValueError, match=r"stores only layers \[4\].*--layers 1,2,4"):
        Eagle3Drafter.for_run(only_last, target, 3)
    with pytest.raises(ValueError, match=r"missing \[3\]"):
        Eagle3Drafter.for_run(only_last, target, 3, aux_layer_ids=(3,))
    with pytest.raises(TypeError):
        Eagle3Drafter.for_run(only_last, target, 3, no_such_option=1)


# -- the proposer, driven by hand with states from a plain transformers forward -----------------------------------


@pytest.fixture
def trained_head(family_head):
    """(checkpoint folder, drafter): the session's EAGLE-3 head (conftest.family_head: a 48-token draft vocabulary,
    two training steps on the run), saved in the speculators layout."""
    folder, drafter, _ = family_head("eagle3")
    return folder, drafter


@pytest.fixture
def runner(engine_runner):
    return engine_runner


def _aux_states(model, ids: list[int], layer_ids) -> torch.Tensor:
    """[T, A, H] the target's states of `ids` at `layer_ids` (vLLM ids), from a plain transformers forward."""
    from harness.runs import pre_norm_hidden_states

    states = pre_norm_hidden_states(model, torch.tensor(ids))
    return torch.stack([states[i] for i in layer_ids], dim=1)


def _greedy():
    from extractor.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=16)


def test_proposer_drafts_what_the_training_unroll_predicts(trained_head, runner, oracle_model):
    """The cache-based decoding path and the masked training unroll agree: chain t = len(ctx) - 2 fed the
    proposer's own drafts as its tokens predicts exactly those drafts."""
    from drafters.eagle3_proposer import Eagle3Proposer

    folder, drafter = trained_head
    model, tokenizer = oracle_model
    ctx = tokenizer("the quick model reads a batch of hidden states")["input_ids"]
    proposer = Eagle3Proposer(folder, runner, 3)
    assert proposer.capture_layer_ids == (1, 2)
    proposer.start([ctx])
    proposer.observe([_aux_states(model, ctx[:-1], (1, 2))])
    drafts = proposer.propose([ctx], [3], [_greedy()], [None])[0].token_ids
    assert len(drafts) == 3

    seq = ctx + drafts  # the unroll's step s at chain t embeds seq[t+1+s]
    aux = torch.zeros(1, len(seq), 2, 64)
    aux[0, :len(ctx) - 1] = _aux_states(model, ctx[:-1], (1, 2))
    with torch.no_grad():
        outputs = drafter.unroll(aux, torch.tensor([seq]), torch.arange(len(seq))[None],
                                 torch.zeros(1, len(seq), dtype=torch.long), 3)
    chain = len(ctx) - 2
    assert [int(drafter.draft_ids[drafter.logits(outputs[s][0, chain]).argmax()]) for s in range(3)] == drafts


@pytest.mark.slow
def test_proposer_cache_after_rollbacks_equals_a_fresh_one_and_decoding_stays_greedy(trained_head, runner,
                                                                                     oracle_model):
    """A hand-driven greedy speculative loop (target verification by a plain forward): at every round the
    proposer, which keeps its cache and rolls back rejected drafts, drafts what a fresh proposer fed the whole
    context drafts; the output equals transformers generate."""
    from drafters.eagle3_proposer import Eagle3Proposer

    folder, _ = trained_head
    model, tokenizer = oracle_model
    prompts = [tokenizer("a small dog jumps over the river")["input_ids"], tokenizer("one two three four")["input_ids"]]
    proposer = Eagle3Proposer(folder, runner, 3)
    contexts = [list(p) for p in prompts]
    proposer.start(contexts[:1])
    proposer.join(contexts[1:])  # continuous batching: a row appended later
    states = [_aux_states(model, c[:-1], (1, 2)) for c in contexts]
    proposer.observe(states)
    new_tokens = 8
    while min(len(c) - len(p) for c, p in zip(contexts, prompts)) < new_tokens:
        drafts = [d.token_ids for d in proposer.propose(contexts, [3, 2], [_greedy()] * 2, [None, None])]
        assert [len(d) for d in drafts] == [3, 2]
        fresh = Eagle3Proposer(folder, runner, 3)
        fresh.start(contexts)
        fresh.observe(states)
        assert [d.token_ids for d in fresh.propose(contexts, [3, 2], [_greedy()] * 2, [None, None])] == drafts
        accepted, observed, states = [], [], []
        for ctx, draft in zip(contexts, drafts):
            with torch.no_grad():
                target = model(torch.tensor([ctx + draft])).logits[0, len(ctx) - 1:].argmax(-1).tolist()
            a = 0
            while a < len(draft) and draft[a] == target[a]:
                a += 1
            accepted.append(a)
            old = len(ctx)
            ctx += draft[:a] + [target[a]]
            states.append(_aux_states(model, ctx[:-1], (1, 2)))
            observed.append(states[-1][old - 1:])  # 1 + a new states
        proposer.accepted(accepted)
        proposer.observe(observed)
    for p, ctx in zip(prompts, contexts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=len(ctx) - len(p), do_sample=False)[0].tolist()
        assert ctx == ref
    proposer.select([1])
    assert len(proposer.propose(contexts[1:], [3], [_greedy()], [None])[0].token_ids) == 3


def test_sampled_rows_get_draft_vocabulary_probabilities(trained_head, runner, oracle_model):
    from drafters.eagle3_proposer import Eagle3Proposer
    from extractor.sampling import SamplingParams

    folder, drafter = trained_head
    model, tokenizer = oracle_model
    ctx = tokenizer("write the data to the bucket")["input_ids"]
    proposer = Eagle3Proposer(folder, runner, 3)
    proposer.start([ctx])
    proposer.observe([_aux_states(model, ctx[:-1], (1, 2))])
    gen = torch.Generator().manual_seed(0)
    draft = proposer.propose([ctx], [3], [SamplingParams(temperature=0.8, max_tokens=8)], [gen])[0]
    assert draft.probs is not None and draft.probs.shape == (3, 512)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(3))
    outside = torch.ones(512, dtype=torch.bool)
    outside[drafter.draft_ids] = False
    assert float(draft.probs[:, outside].abs().max()) == 0.0
    assert all(bool(drafter.t2d[t]) for t in draft.token_ids)


def test_a_head_without_embeddings_decodes_on_a_target_whose_norm_hsx_does_not_know(trained_head, tiny_llama,
                                                                                     tmp_path):
    """An EAGLE-3 head reads nothing of the target but its input embeddings, and those only when its checkpoint
    leaves them out (speculators may): the engine hands it the loaded target's, so a head for a model type whose
    final norm hsx has not checked (Gemma here) still decodes, and its verifier folder need not exist."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GemmaConfig

    from drafters.eagle3 import Eagle3Drafter
    from drafters.eagle3_proposer import Eagle3Proposer
    from extractor.config import EngineConfig
    from extractor.runner import ModelRunner
    from extractor.sampling import SamplingParams

    folder, drafter = trained_head
    gemma = tmp_path / "gemma"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GemmaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, pad_token_id=0)).save_pretrained(gemma)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src := os.path.join(tiny_llama, name)) and os.path.exists(src):
            shutil.copy(src, gemma / name)
    runner = ModelRunner(EngineConfig(model=str(gemma), dtype="float32", device="cpu"))
    head = tmp_path / "head"
    shutil.copytree(folder, head)
    state = load_file(head / "model.safetensors")
    del state["embed_tokens.weight"]
    save_file(state, head / "model.safetensors")
    doc = json.loads((head / "config.json").read_text())
    doc["speculators_config"]["verifier"]["name_or_path"] = str(tmp_path / "gone")
    (head / "config.json").write_text(json.dumps(doc))

    proposer = Eagle3Proposer(str(head), runner, 3)
    assert torch.equal(proposer.drafter.embed_tokens.weight, runner.model.get_input_embeddings().weight)
    ctx = [5, 9, 14, 3, 8]
    with torch.no_grad():
        states = runner.model(torch.tensor([ctx[:-1]]), output_hidden_states=True).hidden_states
    proposer.start([ctx])
    proposer.observe([torch.stack([states[i][0] for i in drafter.aux_layer_ids], dim=1)])
    assert len(proposer.propose([ctx], [3], [SamplingParams(temperature=0.0, max_tokens=8)], [None])[0].token_ids) == 3
    # outside the engine, with no embeddings at hand and no verifier folder: the error names both ways out
    with pytest.raises(ValueError, match="holds no embed_tokens.weight and its verifier .* is not a local folder"):
        Eagle3Drafter.from_pretrained(str(head))


# -- end to end: hsx's engine decodes with a trained head -----------------------------------------------------------


@pytest.mark.slow
def test_engine_decoding_with_a_trained_head_equals_generate_and_accepts_its_drafts(tiny_llama, oracle_model,
                                                                                     tmp_path):
    """A head overfit (through train_drafter) on the target's own greedy continuations of three prompts, served by
    LLM(speculative_config={"method": "eagle3", ...}): the output equals transformers generate token for token, and
    the head's drafts are mostly accepted — which holds only if the engine hands the proposer the right layers'
    states of the right tokens."""
    from extractor import LLM, SamplingParams
    from tests.drafters.helpers import PROMPTS, greedy_run
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    model, tokenizer = oracle_model
    prompts = list(PROMPTS)
    refs = greedy_run(oracle_model, tiny_llama, str(tmp_path / "run"), (1, 2, 4))
    head = str(tmp_path / "head")
    train_drafter(TrainDrafterConfig(run=str(tmp_path / "run"), model=tiny_llama, out=head, steps=30, lr=1e-2,
                                     batch_tokens=128, draft_vocab_size=64, max_grad_norm=1.0, device="cpu",
                                     progress=False))

    llm = LLM(model=tiny_llama, dtype="float32", device="cpu",
              speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outputs] == refs
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    mean_al = 1 + metrics["vllm:spec_decode_num_accepted_tokens"].value / drafts
    assert drafts > 0 and mean_al >= 2.0, (mean_al, metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values)
    # a sampled row (drafts with their probabilities) next to a greedy one: the greedy row is unchanged
    mixed = llm.generate(prompts[:2], [SamplingParams(temperature=0.8, max_tokens=12, seed=3),
                                       SamplingParams(temperature=0.0, max_tokens=12)])
    assert 0 < len(mixed[0].outputs[0].token_ids) <= 12 and mixed[1].outputs[0].token_ids == refs[1]
    # a token budget under the prompts' lengths: the head takes the prompts' states in forwards of at most 4 entries
    # (its decode calls recorded) and drafts exactly what it drafted in one forward each
    small = LLM(model=tiny_llama, dtype="float32", device="cpu", max_num_batched_tokens=4,
                speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    shapes, decode = [], small.proposer.drafter.decode
    small.proposer.drafter.decode = lambda tok, *a: shapes.append(tuple(tok.shape)) or decode(tok, *a)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
            ] == refs
    assert max(rows * cols for rows, cols in shapes) <= 4 and max(len(tokenizer(p)["input_ids"]) for p in prompts) > 4
    again = {m.name: m for m in small.get_metrics()}
    for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
        assert again[name].value == metrics[name].value, name


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_the_checkpoint_tells_vllm_how_many_aux_layers_fc_fuses(family_head, kind):
    """vLLM sizes fc from transformer_layer_config.num_aux_hidden_states and assumes three without it (a two-layer
    head failed its load); tests/vllm_engine/test_drafters_in_vllm.py loads such heads in real vLLM."""
    folder, drafter, _ = family_head(kind)
    with open(os.path.join(folder, "config.json")) as f:
        doc = json.load(f)
    aux = doc["eagle_aux_hidden_state_layer_ids"]
    assert doc["transformer_layer_config"]["num_aux_hidden_states"] == len(aux) == len(drafter.aux_layer_ids)
    assert drafter.fc.in_features == len(aux) * doc["target_hidden_size"]


# -- image tokens: the target's merged input embeddings in place of the placeholder's (drafters/images.py) -----------
def _with_image_rows(drafter, values: torch.Tensor):
    """A copy of `drafter` whose embedding table has `values` [N, H] appended as ids V..V+N-1: embedding an image
    token through a plain lookup, the oracle for the override."""
    import copy

    oracle = copy.deepcopy(drafter)
    table = oracle.embed_tokens.weight.data
    oracle.embed_tokens = torch.nn.Embedding(table.shape[0] + values.shape[0], table.shape[1])
    oracle.embed_tokens.weight.data = torch.cat([table, values.to(table.dtype)])
    return oracle


def test_training_unroll_embeds_image_tokens_with_the_targets_merged_embeddings(trained_head):
    folder, drafter = trained_head
    seq = list(range(20, 36))
    image_at = [4, 5, 6, 11]
    g = torch.Generator().manual_seed(0)
    values = torch.randn(len(seq), 64, generator=g)
    mask = torch.zeros(1, len(seq), dtype=torch.bool)
    mask[0, image_at] = True
    aux = torch.randn(1, len(seq), 2, 64, generator=g)
    pos, doc = torch.arange(len(seq))[None], torch.zeros(1, len(seq), dtype=torch.long)
    vocab = drafter.embed_tokens.weight.shape[0]
    oracle = _with_image_rows(drafter, values[image_at])
    oracle_ids = torch.tensor([seq])
    oracle_ids[0, image_at] = torch.arange(vocab, vocab + len(image_at))
    with torch.no_grad():
        got = drafter.unroll_steps(aux, torch.tensor([seq]), pos, doc, [None] * 3, (mask, values[None]))
        want = oracle.unroll_steps(aux, oracle_ids, pos, doc, [None] * 3)
        plain = drafter.unroll_steps(aux, torch.tensor([seq]), pos, doc, [None] * 3)
    for s in range(3):
        torch.testing.assert_close(got[s].hidden, want[s].hidden, rtol=0, atol=0)
    assert not torch.equal(got[0].hidden, plain[0].hidden)  # the override reached the draft layers


def test_proposer_feeds_image_tokens_the_embeddings_training_read(trained_head, runner, oracle_model):
    """Drafts of a row whose prompt holds image tokens (MediaPrompt.mm_token_type_ids, image_features) equal what
    the training unroll with the same merged embeddings and the target's positions (M-RoPE's time stream, as vLLM
    feeds a drafter) predicts."""
    from drafters.eagle3_proposer import Eagle3Proposer
    from extractor.multimodal import MediaPrompt

    folder, drafter = trained_head
    model, tokenizer = oracle_model
    ctx = tokenizer("the quick model reads a batch of hidden states from disk")["input_ids"]
    image_at = [2, 3, 4]
    features = torch.randn(len(image_at), 64, generator=torch.Generator().manual_seed(1))
    types = torch.zeros(len(ctx), dtype=torch.uint8)
    types[image_at] = 1
    # M-RoPE's time stream: the image's three tokens share one time, the text after it goes on from the next
    times = torch.tensor([0, 1, 2, 2, 2] + list(range(3, len(ctx) - 2)))
    media = MediaPrompt(input_ids=list(ctx), image_features=features, image_grid_thw=torch.tensor([[1, 2, 6]]),
                        mm_token_type_ids=types, positions=times.expand(3, -1), next_position=int(times[-1]) + 1,
                        tokens_per_image=(3,))
    proposer = Eagle3Proposer(folder, runner, 3)
    proposer.start([ctx])
    proposer.media([media])
    states = _aux_states(model, ctx[:-1], (1, 2))
    proposer.observe([states])
    drafts = proposer.propose([ctx], [3], [_greedy()], [None])[0].token_ids

    seq = ctx + drafts
    aux = torch.zeros(1, len(seq), 2, 64)
    aux[0, :len(ctx) - 1] = states
    mask = torch.zeros(1, len(seq), dtype=torch.bool)
    mask[0, image_at] = True
    values = torch.zeros(1, len(seq), 64)
    values[0, image_at] = features
    positions = torch.cat([times, times[-1] + 1 + torch.arange(len(drafts))])[None]  # as vLLM feeds the drafter
    with torch.no_grad():
        outputs = drafter.unroll_steps(aux, torch.tensor([seq]), positions,
                                       torch.zeros(1, len(seq), dtype=torch.long), [None] * 3, (mask, values))
    chain = len(ctx) - 2
    assert [int(drafter.draft_ids[drafter.logits(outputs[s].grid(1)[0, chain]).argmax()]) for s in range(3)] == drafts
    # the head's state after the verified entries, not only its argmax: every image entry in its place
    torch.testing.assert_close(proposer.last_output[0], outputs[0].grid(1)[0, chain], rtol=1e-5, atol=1e-5)
    plain = Eagle3Proposer(folder, runner, 3)  # without the image embeddings the head reads other inputs
    plain.start([ctx])
    plain.observe([states])
    plain.propose([ctx], [3], [_greedy()], [None])
    assert not torch.equal(plain.last_output[0], proposer.last_output[0])
