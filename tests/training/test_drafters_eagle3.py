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
