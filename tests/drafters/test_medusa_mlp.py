"""Medusa and MLPSpeculator drafters (drafters/medusa.py, mlp_speculator.py): training on a real tiny run,
the serving checkpoint layouts, the alignment of every draft position against per-document loops over a plain
transformers forward, and the proposers driven by hand with the target's states."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from connectors import HiddenStatesSpec
from connectors.run import RunSpec
from drafters.base import DrafterBatch, TargetHead
from drafters.medusa import MedusaConfig, MedusaDrafter
from drafters.medusa_proposer import MedusaProposer
from drafters.mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorDrafter
from drafters.mlp_speculator_proposer import MLPSpeculatorProposer
from harness.runs import pre_norm_hidden_states

KINDS = ("medusa", "mlp_speculator")
DRAFTERS = {"medusa": MedusaDrafter, "mlp_speculator": MLPSpeculatorDrafter}
PROPOSERS = {"medusa": MedusaProposer, "mlp_speculator": MLPSpeculatorProposer}
OPTIONS = {"medusa": {"medusa_num_layers": 2}, "mlp_speculator": {"inner_dim": 48}}


@pytest.fixture(scope="module")
def target(target_head) -> TargetHead:
    return target_head


@pytest.fixture(scope="module")
def run_batch(oracle_run):
    """(DrafterBatch of every sample of the oracle run, packed; the run's RunSpec)."""
    from training import HiddenStatesDataset, PackCollator

    ds = HiddenStatesDataset(oracle_run[0], layout="raw")
    collate = PackCollator(max_tokens=int(ds.num_tokens.max()) + 16)
    batch = collate([ds[i] for i in range(len(ds))])
    return DrafterBatch.from_packed(batch, ds.run_info.layer_ids), ds.run_info


def make_drafter(kind: str, run_spec, target: TargetHead, k: int = 3, seed: int = 0, **options):
    torch.manual_seed(seed)
    drafter = DRAFTERS[kind].for_run(run_spec, target, k, **{**OPTIONS[kind], **options})
    with torch.no_grad():  # away from Medusa's zero init, so that every head and block differs
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return drafter


def draft_logits(drafter, post: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """[n, V] logits of drafts 0..n-1 at one position: post [H] the state of x_t, tokens = x_{t+1}..x_{t+n}."""
    if isinstance(drafter, MedusaDrafter):
        return drafter(post[None], len(tokens))[:, 0]
    return drafter(post[None], torch.tensor([tokens]))[:, 0]


# -- training ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_training_step_loss_decreases_when_overfitting_a_run(kind, run_batch, target):
    batch, run_spec = run_batch
    drafter = make_drafter(kind, run_spec, target)
    opt = torch.optim.Adam(drafter.parameters(), lr=2e-2)
    with torch.no_grad():
        first = drafter.training_step(batch, target)
    for _ in range(12):
        result = drafter.training_step(batch, target)
        opt.zero_grad()
        result.loss.backward()
        opt.step()
    with torch.no_grad():
        last = drafter.training_step(batch, target)
    # distillation's loss has the target's entropy as its floor: the gap, and the agreement, must move
    assert float(last.loss) < 0.9 * float(first.loss), (float(first.loss), float(last.loss))
    assert sum(last.accuracy()) > sum(first.accuracy()) + 0.9, (first.accuracy(), last.accuracy())
    assert last.counted.tolist() == first.counted.tolist() and all(n > 0 for n in last.counted.tolist())
    assert last.simulated_acceptance_length() > first.simulated_acceptance_length()


@pytest.mark.parametrize("targets", ["target", "tokens"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_draft_position_trains_on_the_token_two_plus_j_after_its_state_within_its_sample(
        kind, targets, oracle_run, oracle_model, target):
    """Oracle: per-document loops over a plain transformers forward (its own post-norm last state and logits)."""
    _, samples, spec = oracle_run
    model, _ = oracle_model
    k = 3
    drafter = make_drafter(kind, RunSpec.from_file_spec(spec), target, k, seed=1, targets=targets)
    g = torch.Generator().manual_seed(3)
    docs = [samples[0], samples[1], samples[2]]
    masks = [(torch.rand(s.token_ids.shape[0], generator=g) > 0.3) for s in docs]
    rows = [[0, 1], [2]]  # samples 0 and 1 back to back in row 0: nothing may pair across them
    width = max(sum(docs[i].token_ids.shape[0] for i in row) for row in rows) + 3
    n_layers, hidden = docs[0].hidden_states.shape[1:]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    states = torch.zeros(len(rows), width, n_layers, hidden)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    documents = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n = docs[i].token_ids.shape[0]
            ids[r, at:at + n], states[r, at:at + n] = docs[i].token_ids, docs[i].hidden_states
            loss_mask[r, at:at + n], positions[r, at:at + n], documents[r, at:at + n] = masks[i], torch.arange(n), i
            at += n
    batch = DrafterBatch(ids, states, loss_mask, positions, documents, spec.layer_ids)
    with torch.no_grad():
        result = drafter.training_step(batch, target)

    losses = [[] for _ in range(k)]
    correct = [0] * k
    for doc, mask in zip(docs, masks):
        with torch.no_grad():
            out = model(doc.token_ids[None], output_hidden_states=True)
        post, logits = out.hidden_states[-1][0], out.logits[0]  # [T, H] post-norm, [T, V]
        t_len = doc.token_ids.shape[0]
        for t in range(t_len):
            for j in range(k):
                p = t + 2 + j  # the token draft j at t predicts
                if p >= t_len or not mask[p]:
                    continue
                with torch.no_grad():
                    dl = draft_logits(drafter, post[t], doc.token_ids[t + 1:t + 2 + j].tolist())[j]  # [V]
                if targets == "tokens":
                    losses[j].append(F.cross_entropy(dl[None], doc.token_ids[p:p + 1]))
                else:
                    losses[j].append(-(F.softmax(logits[p - 1], -1) * F.log_softmax(dl, -1)).sum())
                correct[j] += int(dl.argmax() == logits[p - 1].argmax())
    assert result.counted.tolist() == [len(x) for x in losses]
    assert result.correct.tolist() == correct
    per_head = torch.stack([torch.stack(x).mean() for x in losses])
    if kind == "medusa":
        expected = sum(per_head[j] * 0.8 ** j for j in range(k))
    else:
        expected = per_head.mean()
    torch.testing.assert_close(result.loss, expected, rtol=1e-4, atol=1e-5)


# -- checkpoints ---------------------------------------------------------------------------------------------------
def test_medusa_checkpoint_has_vllms_layout_and_reloads_identically(tmp_path, run_batch, target, tiny_llama):
    from safetensors import safe_open

    _, run_spec = run_batch
    drafter = make_drafter("medusa", run_spec, target, k=3)
    drafter.save_pretrained(str(tmp_path), verifier=tiny_llama)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["hidden_size"], config["vocab_size"]) == (target.hidden_size, target.vocab_size)
    assert (config["num_heads"], config["num_hidden_layers"]) == (3, 2)
    assert {"max_paths", "topk"} <= set(config) and config["medusa_fc_bias"] is True
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert tuple(f.get_slice("lm_heads.2.weight").get_shape()) == (target.vocab_size, target.hidden_size)
    expected = {f"blocks.{i}.layers.{j}.{w}" for i in range(3) for j in range(2) for w in ("weight", "bias")}
    assert names == expected | {f"lm_heads.{i}.weight" for i in range(3)}

    reloaded = MedusaDrafter.from_pretrained(str(tmp_path))
    assert reloaded.config == drafter.config
    x = torch.randn(7, target.hidden_size)
    assert torch.equal(reloaded(x), drafter(x))


def test_medusa_checkpoints_with_one_shared_lm_head_load_and_incomplete_ones_are_refused(tmp_path, run_batch, target,
                                                                                         tiny_llama):
    from safetensors.torch import load_file, save_file

    _, run_spec = run_batch
    make_drafter("medusa", run_spec, target, k=3).save_pretrained(str(tmp_path), verifier=tiny_llama)
    weights = load_file(str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    shared = {k: v for k, v in weights.items() if k not in ("lm_heads.1.weight", "lm_heads.2.weight")}
    save_file(shared, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks tensors for .*lm_heads.1.weight"):
        MedusaDrafter.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config, "original_lm_head": True}))
    reloaded = MedusaDrafter.from_pretrained(str(tmp_path))
    for head in reloaded.lm_heads:
        assert torch.equal(head.weight, weights["lm_heads.0.weight"])


@pytest.mark.parametrize("tie_weights", [False, True])
def test_mlp_speculator_checkpoint_has_ibms_layout_and_reloads_identically(tmp_path, run_batch, target, tiny_llama,
                                                                          tie_weights):
    from safetensors import safe_open

    _, run_spec = run_batch
    drafter = make_drafter("mlp_speculator", run_spec, target, k=3, tie_weights=tie_weights, scale_input=tie_weights)
    drafter.save_pretrained(str(tmp_path), verifier=tiny_llama)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "mlp_speculator"
    assert config["architectures"] == ["MLPSpeculatorPreTrainedModel"]
    assert (config["emb_dim"], config["inner_dim"], config["vocab_size"]) == (target.hidden_size, 48,
                                                                              target.vocab_size)
    assert config["n_predict"] == 3 and len(config["top_k_tokens_per_head"]) == 3
    assert (config["tie_weights"], config["scale_input"]) == (tie_weights, tie_weights)
    assert "n_candidates" in config
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert tuple(f.get_slice("proj.0.weight").get_shape()) == (48, target.hidden_size)
        assert tuple(f.get_slice("proj.1.weight").get_shape()) == (48, 48)
        assert tuple(f.get_slice("emb.1.weight").get_shape()) == (target.vocab_size, 48)
    assert names == {f"{m}.{i}.{w}" for i in range(3) for m, w in
                     [("emb", "weight"), ("proj", "weight"), ("head", "weight"), ("ln", "weight"), ("ln", "bias")]}

    reloaded = MLPSpeculatorDrafter.from_pretrained(str(tmp_path))
    assert reloaded.config == drafter.config
    x, tokens = torch.randn(7, target.hidden_size), torch.randint(0, target.vocab_size, (7, 3))
    assert torch.equal(reloaded(x, tokens), drafter(x, tokens))


def test_a_checkpoint_of_another_kind_is_refused(tmp_path, run_batch, target, tiny_llama):
    _, run_spec = run_batch
    make_drafter("medusa", run_spec, target).save_pretrained(str(tmp_path), verifier=tiny_llama)
    with pytest.raises(ValueError, match="model_type 'medusa', not 'mlp_speculator'"):
        MLPSpeculatorDrafter.from_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        MedusaDrafter.from_pretrained(str(tmp_path / "nothing"))


@pytest.mark.parametrize("kind", KINDS)
def test_for_run_refuses_unknown_options_conflicting_k_and_a_run_of_another_width(kind, run_batch, target):
    _, run_spec = run_batch
    with pytest.raises(TypeError):
        DRAFTERS[kind].for_run(run_spec, target, 3, no_such_option=1)
    count = {"medusa": "medusa_num_heads", "mlp_speculator": "n_predict"}[kind]
    with pytest.raises(ValueError, match="disagree"):
        DRAFTERS[kind].for_run(run_spec, target, 3, **{count: 4})
    other = RunSpec.from_file_spec(HiddenStatesSpec(layer_ids=(4,), num_hidden_layers=4, hidden_size=32,
                                                    dtype="float32", model="other"))
    with pytest.raises(ValueError, match="another model"):
        DRAFTERS[kind].for_run(other, target, 3)
    assert DRAFTERS[kind].required_layer_ids(4, None) == (4,)


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_without_the_last_layer_is_refused(kind, run_batch, target):
    batch, run_spec = run_batch
    drafter = DRAFTERS[kind].for_run(run_spec, target, 2)
    aux_only = DrafterBatch(batch.input_ids, batch.hidden_states[:, :, :2], batch.loss_mask, batch.position_ids,
                            batch.document_ids, batch.layer_ids[:2])
    with pytest.raises(ValueError, match=r"the run has layers \[1, 2\], not 4"):
        drafter.training_step(aux_only, target)


def test_configs_refuse_bad_values():
    with pytest.raises(ValueError, match="medusa_num_heads"):
        MedusaConfig(medusa_num_heads=0)
    with pytest.raises(ValueError, match="targets"):
        MedusaConfig(targets="labels")
    with pytest.raises(ValueError, match="tie_weights"):
        MLPSpeculatorConfig(n_predict=1, tie_weights=True)
    with pytest.raises(ValueError, match="top_k_tokens_per_head"):
        MLPSpeculatorConfig(n_predict=3, top_k_tokens_per_head=(2, 2))


# -- proposers -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runner(engine_runner):
    return engine_runner


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, run_batch, target, tiny_llama):
    """kind -> folder of a 3-draft checkpoint (random weights: greedy losslessness needs no training)."""
    _, run_spec = run_batch
    out = {}
    for kind in KINDS:
        folder = str(tmp_path_factory.mktemp(kind))
        make_drafter(kind, run_spec, target, k=3, seed=5).save_pretrained(folder, verifier=tiny_llama)
        out[kind] = folder
    return out


def oracle_drafts(drafter, model, context: list[int], k: int) -> list[int]:
    """Greedy drafts from a plain transformers forward: HF's post-norm state of context[-2], then each draft's
    argmax (MLPSpeculator: fed its own previous draft)."""
    with torch.no_grad():
        post = model(torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]  # [H]
        if isinstance(drafter, MedusaDrafter):
            return drafter(post[None], k)[:, 0].argmax(-1).tolist()
        tokens = [context[-1]]
        for j in range(k):
            tokens.append(int(drafter(post[None], torch.tensor([tokens]))[j, 0].argmax()))
    return tokens[1:]


def states_of(model, context: list[int], start: int, end: int) -> torch.Tensor:
    """[end - start, 1, H] the last layer's pre-norm states (vLLM id N) of context[start:end]."""
    return pre_norm_hidden_states(model, torch.tensor(context[:end]))[-1][start:end, None]


@pytest.mark.parametrize("kind", KINDS)
def test_proposer_drafts_from_the_newest_observed_state_and_respects_ks(kind, checkpoints, runner, oracle_model):
    from extractor.sampling import SamplingParams

    model, tokenizer = oracle_model
    proposer = PROPOSERS[kind](checkpoints[kind], runner, 3)
    drafter = DRAFTERS[kind].from_pretrained(checkpoints[kind])
    assert proposer.capture_layer_ids == (model.config.num_hidden_layers,)
    contexts = [tokenizer("the quick river writes a batch")["input_ids"], tokenizer("old green tree")["input_ids"]]
    greedy = [SamplingParams(temperature=0.0)] * 3
    proposer.start(contexts)
    proposer.observe([states_of(model, c, 0, len(c) - 1) for c in contexts])
    drafts = proposer.propose(contexts, [3, 2], greedy[:2], [None, None])
    assert [len(d.token_ids) for d in drafts] == [3, 2] and all(d.probs is None for d in drafts)
    assert drafts[0].token_ids == oracle_drafts(drafter, model, contexts[0], 3)
    assert drafts[1].token_ids == oracle_drafts(drafter, model, contexts[1], 2)

    # a verification step: row 0 keeps 1 draft + a bonus token, row 1 none + a bonus; a third row joins (1 token:
    # no state yet, so no draft); then row 1 finishes
    old = [len(c) for c in contexts]
    contexts = [contexts[0] + drafts[0].token_ids[:1] + [7], contexts[1] + [9]]
    proposer.accepted([1, 0])
    proposer.observe([states_of(model, contexts[0], old[0] - 1, old[0] + 1),
                      states_of(model, contexts[1], old[1] - 1, old[1])])
    proposer.join([[5]])
    contexts.append([5])
    nothing = torch.zeros(0, 1, model.config.hidden_size)
    proposer.observe([nothing, nothing, nothing])
    drafts = proposer.propose(contexts, [3, 0, 3], greedy, [None] * 3)
    assert drafts[0].token_ids == oracle_drafts(drafter, model, contexts[0], 3)
    assert drafts[1].token_ids == [] and drafts[2].token_ids == []
    proposer.select([0, 2])
    drafts = proposer.propose([contexts[0], contexts[2]], [1, 1], greedy[:2], [None, None])
    assert drafts[0].token_ids == oracle_drafts(drafter, model, contexts[0], 1) and drafts[1].token_ids == []


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_rows_draw_from_the_requests_distribution_and_return_it(kind, checkpoints, runner, oracle_model):
    from extractor.sampling import SamplingParams, sampling_probs

    model, tokenizer = oracle_model
    proposer = PROPOSERS[kind](checkpoints[kind], runner, 3)
    drafter = DRAFTERS[kind].from_pretrained(checkpoints[kind])
    context = tokenizer("a small cat jumps over the lazy dog")["input_ids"]
    params = SamplingParams(temperature=0.7, top_k=5)
    proposer.start([context])
    proposer.observe([states_of(model, context, 0, len(context) - 1)])
    (draft,) = proposer.propose([context], [3], [params], [torch.Generator().manual_seed(0)])
    assert len(draft.token_ids) == 3 and draft.probs.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(3))
    assert all(int((q > 0).sum()) <= 5 and float(q[t]) > 0 for q, t in zip(draft.probs, draft.token_ids))
    with torch.no_grad():  # each q is the request's distribution over the drafter's logits, given the drafts before
        post = model(torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]
        logits = draft_logits(drafter, post, [context[-1], *draft.token_ids[:2]])  # [3, V]
    for j in range(3):
        torch.testing.assert_close(draft.probs[j], sampling_probs(logits[j], params), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_proposer_refuses_a_drafter_of_another_model_and_too_many_tokens(kind, tmp_path, checkpoints, runner,
                                                                         tiny_model_factory):
    with pytest.raises(ValueError, match="drafts 1 to 3 tokens"):
        PROPOSERS[kind](checkpoints[kind], runner, 4)
    other = tiny_model_factory("llama", hidden_size=32)
    other_target = TargetHead.from_model_dir(other)
    spec = RunSpec.from_file_spec(HiddenStatesSpec(layer_ids=(4,), num_hidden_layers=4, hidden_size=32,
                                                   dtype="float32", model=other))
    DRAFTERS[kind].for_run(spec, other_target, 2).save_pretrained(str(tmp_path), verifier=other)
    with pytest.raises(ValueError, match="trained for another model"):
        PROPOSERS[kind](str(tmp_path), runner, 2)


def test_medusa_heads_start_as_the_targets_lm_head(run_batch, target):
    """Medusa's init: zero residual blocks and lm_heads copied from the target, so every untrained head reproduces
    the target's own next-token logits from the post-norm state."""
    batch, run_spec = run_batch
    drafter = MedusaDrafter.for_run(run_spec, target, 2)
    last = batch.layer(max(batch.layer_ids))[0, :5]  # [5, H]
    logits = drafter(target.post_norm(last))  # [2, 5, V]
    torch.testing.assert_close(logits[0], target.logits(last))
    torch.testing.assert_close(logits[1], target.logits(last))


# -- through the trainer (training/trainer.py) ----------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_train_drafter_trains_each_kind_into_a_checkpoint_its_proposer_loads(kind, tmp_path, oracle_run, tiny_llama,
                                                                              target, runner):
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    out = str(tmp_path / kind)
    report = train_drafter(TrainDrafterConfig(run=oracle_run[0], model=tiny_llama, out=out, kind=kind, steps=6,
                                              lr=1e-2, batch_tokens=128, progress=False, checkpoint_every=100,
                                              family_options=OPTIONS[kind]))
    assert report["steps"] == 6 and len(report["accuracy_per_position"]) == 3
    trained = DRAFTERS[kind].from_pretrained(out)
    assert trained.max_drafts == 3 and json.loads(open(os.path.join(out, "config.json")).read())["model_type"] == kind
    torch.manual_seed(0)  # the trainer's seed: the same initialisation, before any step
    fresh = DRAFTERS[kind].for_run(RunSpec.from_file_spec(oracle_run[2]), target, 3, **OPTIONS[kind])
    moved = [not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), fresh.state_dict().values())]
    assert sum(moved) >= len(moved) // 2  # the steps trained it
    proposer = PROPOSERS[kind](out, runner, 3)
    assert proposer.drafter.max_drafts == 3


@pytest.mark.parametrize("kind", KINDS)
def test_train_drafter_refuses_an_option_the_family_does_not_have(kind, tmp_path, oracle_run, tiny_llama):
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    with pytest.raises(ValueError, match="bad family option"):
        train_drafter(TrainDrafterConfig(run=oracle_run[0], model=tiny_llama, out=str(tmp_path), kind=kind, steps=1,
                                         progress=False, family_options={"num_layers": 2}))




# -- decoding through the engine (extractor.LLM with speculative_config) ----------------------------------------------
def overfit_on_greedy_outputs(kind: str, model, sequences: list[list[int]], target: TargetHead, steps: int = 40):
    """A drafter trained on the target's own greedy continuations (states from a plain transformers forward)."""
    from training import PackCollator

    n = model.config.num_hidden_layers
    items = []
    for seq in sequences:
        ids = torch.tensor(seq)
        items.append({"input_ids": ids, "hidden_states": pre_norm_hidden_states(model, ids)[n][:, None],
                      "loss_mask": torch.ones(len(seq), dtype=torch.long)})
    batch = DrafterBatch.from_packed(PackCollator(max(map(len, sequences)))(items), (n,))
    spec = RunSpec.from_file_spec(HiddenStatesSpec(layer_ids=(n,), num_hidden_layers=n,
                                                   hidden_size=model.config.hidden_size, dtype="float32"))
    torch.manual_seed(0)
    drafter = DRAFTERS[kind].for_run(spec, target, 3)
    opt = torch.optim.Adam(drafter.parameters(), lr=1.5e-2)
    for _ in range(steps):
        loss = drafter.training_step(batch, target).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_decoding_equals_transformers_generate_and_a_fitted_drafter_is_accepted(
        kind, tmp_path, oracle_model, tiny_llama, target):
    from extractor import LLM, SamplingParams
    from extractor.config import checkpoint_method, checkpoint_num_speculative_tokens
    from reference.tiny_models import sample_text

    model, tokenizer = oracle_model
    prompts = [tokenizer(t)["input_ids"] for t in sample_text(3, seed=11, min_words=2, max_words=10)] + [[5]]
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        expected.append(out[0, len(p):].tolist())
    ckpt = str(tmp_path / kind)
    drafter = overfit_on_greedy_outputs(kind, model, [p + e for p, e in zip(prompts, expected) if len(p) > 1], target)
    drafter.save_pretrained(ckpt, verifier=tiny_llama)
    assert (checkpoint_method(ckpt), checkpoint_num_speculative_tokens(ckpt)) == (kind, 3)  # what vLLM infers

    # max_num_seqs=2: the 4 prompts join a running batch (continuous batching), so join/select are exercised
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", max_num_seqs=2,
              speculative_config={"method": kind, "model": ckpt, "num_speculative_tokens": 3})
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=16))
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    # measured 2.19 for both kinds, and 1.76 when the proposer keeps the first state a verification observes instead
    # of the newest: the engine has to feed the drafter the right states for this to hold
    assert drafts > 0 and 1 + accepted / drafts > 2.0, (drafts, accepted)
    sampled = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.8, top_k=20, max_tokens=6, seed=1))
    assert all(len(o.outputs[0].token_ids) == 6 or o.outputs[0].finish_reason == "stop" for o in sampled)
