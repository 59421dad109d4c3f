"""Issue 52's rewrites change no loss and no gradient: the test-time-training families (EAGLE-3, P-EAGLE, EAGLE) and
DFlash trained on packed rows of several documents, partly loss-masked, against the dense forward they replaced —
every chain at every step over one [R, S, S * (s + 1)] boolean mask through a transformers DynamicCache (EAGLE-3's
mask, written out here as the oracle), DFlash's blocks over one dense [R, Q, S + Q] mask — on the same draws (COD
sampling, anchors)."""

from __future__ import annotations

import pytest
import torch

from tests.drafters.helpers import family_setup
from tests.drafters.helpers import packed_batch as _batch


def ttt_mask(document_ids: torch.Tensor, step: int) -> torch.Tensor:
    """[R, 1, S, S*(step+1)] bool: step `step`'s queries over the keys of steps 0..step: step 0's causal within the
    document, each later step's the chain's own key only (the diagonal)."""
    r, s = document_ids.shape
    ar = torch.arange(s, device=document_ids.device)
    eye = (ar[:, None] == ar[None, :]).expand(r, s, s)
    causal = (ar[:, None] >= ar[None, :])[None] & (document_ids[:, :, None] == document_ids[:, None, :])
    return torch.cat([causal | eye] + [eye] * step, dim=-1)[:, None]


def dense_unroll(decode, first_hidden, input_ids, position_ids, document_ids, chains, step_inputs=None):
    """The unroll before issue 52: every chain at every step, attention through a DynamicCache and ttt_mask."""
    from transformers import DynamicCache

    from drafters.ttt import UnrollStep, shift_left

    r, s_len = input_ids.shape
    cache, hidden, out = DynamicCache(), first_hidden, []
    for s in range(len(chains)):
        ids = shift_left(input_ids, 1 + s)
        if step_inputs is not None:
            ids, hidden = step_inputs(s, ids, hidden)
        hidden = decode(ids, hidden, position_ids + s, ttt_mask(document_ids, s), cache)
        out.append(UnrollStep(hidden.reshape(r * s_len, -1), None, s_len))
    return out


def _masked_batch(ds):
    """Four documents packed into two rows, a stretch of each document's tokens not trained (so a chain may be
    trained at a step and not at the one before it)."""
    batch = _batch(ds, [0, 1, 2, 0], max_tokens=96)
    loss_mask = batch.loss_mask.clone()
    loss_mask[:, 5:9] = False
    loss_mask[:, 40:42] = False
    batch.loss_mask = loss_mask
    assert int((batch.document_ids[0] >= 0).sum()) > 0 and int(batch.document_ids.max()) >= 2
    return batch


def _loss_and_grads(drafter, target, batch, seed):
    torch.manual_seed(seed)
    drafter.zero_grad()
    result = drafter.training_step(batch, target)
    result.loss.backward()
    grads = {k: p.grad.clone() for k, p in drafter.named_parameters() if p.grad is not None}
    return result, grads


def _compare(drafter, target, batch, patch_target, reference, monkeypatch, seed=7):
    new, new_grads = _loss_and_grads(drafter, target, batch, seed)
    with monkeypatch.context() as m:
        m.setattr(patch_target, reference)
        old, old_grads = _loss_and_grads(drafter, target, batch, seed)
    assert float(new.loss) > 0
    torch.testing.assert_close(new.loss, old.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(new.counted, old.counted) and torch.equal(new.correct, old.correct)
    assert new_grads.keys() == old_grads.keys() and len(new_grads) > 3
    for name in new_grads:
        torch.testing.assert_close(new_grads[name], old_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    return new


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "eagle"])
def test_ttt_families_train_exactly_as_the_dense_unroll(kind, oracle_run, tiny_llama, monkeypatch):
    from drafters.registry import drafter_class

    options = {"eagle3": dict(draft_vocab_size=48, ttt_steps=3, num_layers=2),
               "peagle": dict(draft_vocab_size=48, ttt_steps=5), "eagle": dict(ttt_steps=3, num_layers=2)}[kind]
    ds, target, drafter = family_setup(oracle_run, tiny_llama, drafter_class(kind), **options)
    batch = _masked_batch(ds)
    module = "drafters.eagle.unroll_chains" if kind == "eagle" else "drafters.eagle3.unroll_chains"
    result = _compare(drafter, target, batch, module, dense_unroll, monkeypatch)
    if kind == "peagle":  # COD: deeper depths count fewer chains, so the sampled forward ran fewer
        assert int(result.counted[-1]) < int(result.counted[0])


def test_peagle_runs_only_the_sampled_depths(oracle_run, tiny_llama):
    """The forward of depth d >= 1 runs the chains trained at d or deeper only: its rows shrink with COD's
    fractions (0.7, 0.49, 0.34, 0.24 of the chains)."""
    from drafters.peagle import PEagleDrafter

    ds, target, drafter = family_setup(oracle_run, tiny_llama, PEagleDrafter, draft_vocab_size=48, ttt_steps=5)
    batch = _batch(ds, [0, 1, 2, 0, 1, 2], max_tokens=256)
    seen = []
    decode = drafter.decode
    drafter.decode = lambda ids, *a: seen.append(ids.numel()) or decode(ids, *a)
    torch.manual_seed(3)
    drafter.training_step(batch, target)
    assert seen[0] == batch.input_ids.numel()  # depth 0: every position (its keys are every depth's context)
    assert all(b < a for a, b in zip(seen, seen[1:])), seen
    assert seen[-1] < 0.45 * seen[1], seen


def test_dflash_trains_exactly_as_the_dense_block_mask(oracle_run, tiny_llama, monkeypatch):
    from drafters.dflash import BlockLayout, DFlashDrafter

    ds, target, drafter = family_setup(oracle_run, tiny_llama, DFlashDrafter, block_size=4, max_anchors=24)
    batch = _masked_batch(ds)

    def dense_mask(document_ids, anchors, block):
        """[R, 1, Q, S + Q]: slot of block i sees the context j < anchor_i of its document and its own block."""
        r, s = document_ids.shape
        n = anchors.shape[1]
        a_doc = document_ids.gather(1, anchors)
        ctx_ok = (torch.arange(s)[None, None] < anchors[:, :, None]) & (document_ids[:, None, :] == a_doc[:, :, None])
        q = n * block
        mask = torch.zeros((r, q, s + q), dtype=torch.bool)
        mask[:, :, :s] = ctx_ok.repeat_interleave(block, dim=1)
        block_id = torch.arange(q) // block
        mask[:, :, s:] = (block_id[:, None] == block_id[None, :])[None]
        return mask[:, None]

    assert isinstance(BlockLayout.of(batch.document_ids, torch.tensor([[1, 3], [2, 4]]), 4), BlockLayout)
    _compare(drafter, target, batch, "drafters.dflash.BlockLayout.of", dense_mask, monkeypatch)
