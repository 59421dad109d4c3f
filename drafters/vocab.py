"""The draft vocabulary of an EAGLE-3 head: the run's most frequent trained tokens, and the maps to the target's.

    count_tokens(dataset, vocab_size)              [V] int64 counts of the loss-masked tokens of a raw-layout run
    DraftVocab.from_counts(counts, size)           the `size` most frequent ids (ties: lower id first), sorted by id
    build_draft_vocab(dataset, vocab_size, size)   both at once
    vocab.d2t  [D] int64   target_id = draft_idx + d2t[draft_idx]      (speculators' / vLLM's names and meaning)
    vocab.t2d  [V] bool    t2d[target_id]: the target token is in the draft vocabulary
    DraftVocab.from_maps(d2t, t2d)                 back from a checkpoint's tensors (checked)

A draft vocabulary as large as the target's is the identity (d2t all zeros, t2d all True); checkpoints then omit the
maps, as speculators does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


def count_tokens(items: Iterable[Mapping[str, Any]], vocab_size: int) -> torch.Tensor:
    """[V] int64: how often each token id occurs with loss_mask 1 over `items` (HiddenStatesDataset items or
    batches with input_ids and loss_mask). An id outside 0..V-1 is an error: the run is not from this target."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for item in items:
        ids = item["input_ids"].reshape(-1)  # [T]
        mask = item["loss_mask"].reshape(-1).bool()  # [T]
        ids = ids[mask]
        if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            raise ValueError(f"the run holds token id {int(ids.max())} (or a negative one), outside the target's "
                             f"vocabulary of {vocab_size}: the run was extracted with another tokenizer or model; "
                             "train against the model the run was extracted from")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


@dataclass(frozen=True)
class DraftVocab:
    """The draft vocabulary as the target ids it holds, ascending."""

    draft_to_target: torch.Tensor  # [D] int64, strictly increasing target ids
    target_vocab_size: int

    def __post_init__(self) -> None:
        ids = self.draft_to_target
        if ids.dtype != torch.int64 or ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"a draft vocabulary is a non-empty 1-D int64 tensor of target ids, got {ids.dtype} "
                             f"{tuple(ids.shape)}")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft vocabulary ids must be strictly increasing (sorted, no repeats)")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.target_vocab_size:
            raise ValueError(f"draft vocabulary ids span {int(ids[0])}..{int(ids[-1])}, outside the target's "
                             f"vocabulary 0..{self.target_vocab_size - 1}")

    @property
    def size(self) -> int:
        return int(self.draft_to_target.numel())

    @property
    def is_identity(self) -> bool:
        return self.size == self.target_vocab_size

    @property
    def d2t(self) -> torch.Tensor:
        """[D] int64 offsets: target_id = draft_idx + d2t[draft_idx]."""
        return self.draft_to_target - torch.arange(self.size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:
        """[V] bool: which target tokens the draft vocabulary holds."""
        out = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        out[self.draft_to_target] = True
        return out

    @classmethod
    def identity(cls, vocab_size: int) -> DraftVocab:
        return cls(torch.arange(vocab_size, dtype=torch.int64), vocab_size)

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int) -> DraftVocab:
        """The `size` most frequent ids of `counts` [V] (ties broken by the lower id), sorted by id; `size` >= V
        gives the whole vocabulary."""
        vocab_size = int(counts.numel())
        if size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {size}")
        if size >= vocab_size:
            return cls.identity(vocab_size)
        # stable sort on -count keeps ascending ids among equal counts
        order = torch.sort(-counts.to(torch.int64), stable=True).indices  # [V]
        return cls(torch.sort(order[:size]).values, vocab_size)

    @classmethod
    def from_maps(cls, d2t: torch.Tensor, t2d: torch.Tensor) -> DraftVocab:
        """From a checkpoint's d2t [D] and t2d [V]; the two must describe the same vocabulary."""
        d2t = d2t.to(torch.int64)
        vocab = cls(d2t + torch.arange(d2t.numel(), dtype=torch.int64), int(t2d.numel()))
        if not torch.equal(vocab.t2d, t2d.bool()):
            raise ValueError("the checkpoint's d2t and t2d disagree (t2d marks other target ids than d2t maps to); "
                             "the checkpoint is damaged — re-save it")
        return vocab


def build_draft_vocab(items: Iterable[Mapping[str, Any]], vocab_size: int, size: int) -> DraftVocab:
    """The draft vocabulary of `size` tokens from the loss-masked tokens of `items` (a raw-layout dataset)."""
    return DraftVocab.from_counts(count_tokens(items, vocab_size), size)
