"""EAGLE-3 trained on a top-k target run (issue 25): the teacher is the stored top-K distribution; with K the whole
vocabulary it is the target's own distribution, so the loss equals training on the run that stores layer N. Families
that read layer N's state itself refuse such runs, naming why."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from connectors.format import TARGET_TOPK_IDS, TARGET_TOPK_LOGPROBS
from drafters.base import topk_distribution
from drafters.vocab import DraftVocab
from harness.runs import ORACLE_LAYERS, Sample, write_run

AUX = tuple(i for i in ORACLE_LAYERS if i != 4)


def topk_run(out: str, oracle_run, oracle_model, k: int) -> str:
    """The oracle run's samples with layer N replaced by the top-K of a plain transformers forward's logits."""
    _, samples, spec = oracle_run
    model, _ = oracle_model
    topk_samples = []
    for s in samples:
        with torch.no_grad():
            top = model(s.token_ids[None]).logits[0].float().log_softmax(-1).topk(k)
        topk_samples.append(Sample(s.sample_id, s.token_ids, s.hidden_states[:, :len(AUX)].contiguous(), s.loss_mask,
                                   {TARGET_TOPK_IDS: top.indices.to(torch.int32), TARGET_TOPK_LOGPROBS: top.values}))
    write_run(out, topk_samples, dataclasses.replace(spec, layer_ids=AUX, target=f"top_k:{k}"))
    return out


def test_topk_distribution_is_the_target_softmax_over_the_kept_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3  # [M, V]
    draft = torch.tensor([1, 4, 7, 9, 20, 33, 41, 49])  # a draft vocabulary of 8
    index = torch.full((50,), -1)
    index[draft] = torch.arange(8)
    top = logits.log_softmax(-1).topk(10)
    got = topk_distribution(top.indices, top.values, index, 8)  # [M, 8]
    kept = torch.zeros(6, 50, dtype=torch.bool).scatter(1, top.indices, True)[:, draft]  # top-10 and in the draft
    expected = F.softmax(logits[:, draft].masked_fill(~kept, float("-inf")), -1).nan_to_num(0.0)
    torch.testing.assert_close(got, expected)
    whole = logits.log_softmax(-1).topk(50)  # K = V: the target's distribution on the draft vocabulary
    torch.testing.assert_close(topk_distribution(whole.indices, whole.values, index, 8), F.softmax(logits[:, draft], -1))


def test_the_dataset_yields_the_topk_target_in_both_layouts(oracle_run, oracle_model, tmp_path):
    from training import HiddenStatesDataset

    out = topk_run(str(tmp_path / "run"), oracle_run, oracle_model, 16)
    _, samples, _ = oracle_run
    raw = HiddenStatesDataset(out)[2]
    assert raw["hidden_states"].shape == (len(samples[2].token_ids), len(AUX), 64)
    assert raw[TARGET_TOPK_IDS].shape == raw[TARGET_TOPK_LOGPROBS].shape == (len(samples[2].token_ids), 16)
    eagle = HiddenStatesDataset(out, layout="eagle3")[2]
    assert torch.equal(eagle["aux_hidden_states"], raw["hidden_states"].flatten(1))  # every stored layer is aux
    assert "target_hidden_states" not in eagle and torch.equal(eagle[TARGET_TOPK_IDS], raw[TARGET_TOPK_IDS])
    with pytest.raises(ValueError, match="keeps a top_k:16 target in place of layer 4, so there is no last layer"):
        HiddenStatesDataset(out, normalize_last_layer=True)
    with pytest.raises(ValueError, match=r"target: '' vs 'top_k:16'; mixed runs cannot be read"):
        HiddenStatesDataset([oracle_run[0], out])


@pytest.mark.parametrize("chunk", [0, 5])  # 5: --ce-chunk-tokens, the top-k teacher computed chunk by chunk
def test_eagle3_on_a_whole_vocabulary_topk_run_trains_as_on_the_run_that_stores_layer_n(chunk, oracle_run, oracle_model,
                                                                                         tiny_llama, tmp_path):
    from drafters.base import DrafterBatch, TargetHead
    from drafters.eagle3 import Eagle3Drafter
    from drafters.memory import MemoryOptions
    from training import HiddenStatesDataset, PackCollator

    states_ds = HiddenStatesDataset(oracle_run[0])
    topk_ds = HiddenStatesDataset(topk_run(str(tmp_path / "run"), oracle_run, oracle_model, 512))  # K = V
    target = TargetHead.from_model_dir(tiny_llama)
    drafters = []
    for ds in (states_ds, topk_ds):
        torch.manual_seed(0)
        drafter = Eagle3Drafter.for_run(ds.run_info, target, 3, draft_vocab_size=48)
        assert drafter.aux_layer_ids == AUX
        drafters.append(drafter)
    drafters[0].prepare(states_ds)
    drafters[1].set_vocab(DraftVocab.from_maps(drafters[0].d2t, drafters[0].t2d))
    drafters[1].load_state_dict(drafters[0].state_dict())
    drafters[1].use_memory(MemoryOptions(ce_chunk_tokens=chunk))
    losses = [[], []]
    optimizers = [torch.optim.AdamW(d.parameters(), lr=1e-3) for d in drafters]
    for step in range(3):  # the same updates, step after step
        for i, (ds, d) in enumerate(zip((states_ds, topk_ds), drafters)):
            batch = DrafterBatch.from_packed(PackCollator(256)([ds[j] for j in (step, step + 1)]), ds.run_info.layer_ids)
            assert (batch.target_topk is None) == (i == 0)
            result = d.training_step(batch, target)
            optimizers[i].zero_grad()
            result.loss.backward()
            optimizers[i].step()
            losses[i].append((float(result.loss.detach()), result.correct.tolist(), result.counted.tolist()))
    for (a, ca, na), (b, cb, nb) in zip(*losses):
        assert abs(a - b) <= 1e-4 * abs(a) and ca == cb and na == nb


@pytest.mark.parametrize("kind", ["medusa", "mlp_speculator"])
def test_families_that_read_layer_n_refuse_a_topk_run_and_write_nothing(kind, oracle_run, oracle_model, tiny_llama,
                                                                         tmp_path):
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    run = topk_run(str(tmp_path / "run"), oracle_run, oracle_model, 8)
    with pytest.raises(ValueError, match=rf"--kind {kind} trains on the state of layer 4 itself, but --run .* keeps a "
                                         r"top_k:8 target in its place .* re-extract with --target states"):
        train_drafter(TrainDrafterConfig(kind=kind, run=run, model=tiny_llama, out=str(tmp_path / "out"), steps=2))
    assert not (tmp_path / "out").exists()


def test_train_drafter_trains_eagle3_on_a_topk_run(oracle_run, oracle_model, tiny_llama, tmp_path):
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    run = topk_run(str(tmp_path / "run"), oracle_run, oracle_model, 16)
    report = train_drafter(TrainDrafterConfig(kind="eagle3", run=run, model=tiny_llama, out=str(tmp_path / "out"),
                                              steps=4, batch_tokens=128, progress=False))
    assert report["steps"] == 4 and (tmp_path / "out" / "config.json").is_file()
