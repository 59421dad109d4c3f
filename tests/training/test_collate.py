"""Padding and packing: every token lands exactly once, at the right place, with correct boundaries."""

from __future__ import annotations

import pytest
import torch

from training.collate import PackCollator, PadCollator
from training.dataset import HiddenStatesDataset


def _items(lengths, h=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 100, (n,), generator=g),
             "loss_mask": torch.randint(0, 2, (n,), generator=g),
             "aux_hidden_states": torch.randn(n, 2 * h, generator=g),
             "target_hidden_states": torch.randn(n, h, generator=g),
             "sample_id": f"id{i}"} for i, n in enumerate(lengths)]


def test_padding_to_the_batch_max_keeps_each_sample_and_masks_the_rest():
    items = _items([5, 2, 7])
    batch = PadCollator(pad_token_id=-7)(items)
    assert batch["input_ids"].shape == (3, 7) and batch["aux_hidden_states"].shape == (3, 7, 8)
    assert batch["lengths"].tolist() == [5, 2, 7]
    assert batch["sample_id"] == ["id0", "id1", "id2"]
    for b, item in enumerate(items):
        n = len(item["input_ids"])
        for key in ("input_ids", "loss_mask", "aux_hidden_states", "target_hidden_states"):
            assert torch.equal(batch[key][b, :n], item[key])
        assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (7 - n)
        assert batch["position_ids"][b, :n].tolist() == list(range(n))
        assert (batch["input_ids"][b, n:] == -7).all() and (batch["loss_mask"][b, n:] == 0).all()
        assert (batch["target_hidden_states"][b, n:] == 0).all()


def test_padding_rounds_up_to_a_multiple():
    assert PadCollator(pad_to_multiple_of=8)(_items([5, 9]))["input_ids"].shape == (2, 16)


@pytest.mark.parametrize("budget,lengths", [(16, [5, 2, 7, 16, 1, 9, 3]), (10, [10, 10, 1, 9]), (64, [3] * 20)])
def test_packing_keeps_every_token_exactly_once_with_correct_boundaries(budget, lengths):
    items = _items(lengths)
    batch = PackCollator(max_tokens=budget, pad_token_id=0)(items)
    rows, s = batch["input_ids"].shape
    assert s == budget
    assert (batch["attention_mask"].sum(1) <= budget).all()
    doc = batch["document_ids"]
    for i, item in enumerate(items):
        where = doc == i
        assert int(where.sum()) == len(item["input_ids"])  # every token once
        r = int(where.any(1).nonzero()[0])  # in exactly one row, contiguous
        cols = where[r].nonzero().flatten()
        assert (where.any(1).sum() == 1) and cols.tolist() == list(range(int(cols[0]), int(cols[0]) + len(cols)))
        for key in ("input_ids", "loss_mask", "aux_hidden_states", "target_hidden_states"):
            assert torch.equal(batch[key][r, cols], item[key])
        assert batch["position_ids"][r, cols].tolist() == list(range(len(cols)))
    # padding only at the end of rows, and it is marked as such
    pad = doc < 0
    assert torch.equal(pad, batch["attention_mask"] == 0)
    assert (batch["input_ids"][pad] == 0).all() and (batch["loss_mask"][pad] == 0).all()
    for r in range(rows):
        real = int(batch["attention_mask"][r].sum())
        assert not pad[r, :real].any()
    # cu_seqlens walks the real tokens in row-major order, one span per sample
    flat_docs = doc[batch["attention_mask"].bool()]
    cu = batch["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == sum(lengths) and batch["cu_seqlens"].dtype == torch.int32
    for k, i in enumerate(batch["sample_index"].tolist()):
        span = flat_docs[cu[k]:cu[k + 1]]
        assert (span == i).all() and len(span) == lengths[i]
    assert sorted(batch["sample_index"].tolist()) == list(range(len(items)))
    assert batch["max_seqlen"] == max(lengths)


def test_packing_refuses_or_truncates_overlong_samples():
    items = _items([4, 12])
    with pytest.raises(ValueError, match="over the packing budget max_tokens=8"):
        PackCollator(max_tokens=8)(items)
    batch = PackCollator(max_tokens=8, overlong="truncate", pad_to_max=False)(items)
    assert batch["lengths"].tolist() == [4, 8]
    assert batch["input_ids"].shape == (2, 8)  # 4 + 8 do not share a row of 8
    r = int((batch["document_ids"] == 1).any(1).nonzero()[0])
    assert torch.equal(batch["input_ids"][r], items[1]["input_ids"][:8])


def test_packing_real_dataset_items(random_run):
    out, samples, _ = random_run
    ds = HiddenStatesDataset(out, layout="eagle3")
    items = [ds[i] for i in range(len(ds))]
    batch = PackCollator(max_tokens=64)(items)
    mask = batch["attention_mask"].bool()
    assert torch.equal(batch["input_ids"][mask], torch.cat([items[i]["input_ids"] for i in batch["sample_index"]]))
    assert torch.equal(batch["target_hidden_states"][mask],
                       torch.cat([samples[i].hidden_states[:, -1] for i in batch["sample_index"]]))
