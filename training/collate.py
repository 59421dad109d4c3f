"""Batching `HiddenStatesDataset` items: pad to the longest sample, or pack several samples into each row.

    PadCollator(pad_token_id=0)       [B, T_max, ...] tensors + attention_mask, position_ids, lengths
    PackCollator(max_tokens=4096)     [R, S, ...] rows each holding whole samples back to back, with per-sample
                                      position_ids and document_ids, plus cu_seqlens / max_seqlen for varlen
                                      attention (flash-attn style) — no sample is ever split across rows

Both pass every tensor field of an item through: input_ids and loss_mask [T], and hidden_states [T, L, H] or
aux_hidden_states [T, (L-1)*H] / target_hidden_states [T, H], whatever the dataset's layout. Padding is
pad_token_id for input_ids and zero elsewhere (loss_mask is 0 on padding, so a loss masked with it ignores pads).
String fields (sample_id) come back as lists in batch order.

An item's `positions` [T] (an image run's: the target's M-RoPE time stream) become its position_ids in place of
0..T-1: drafters rotate by the positions vLLM's proposer feeds them.

A trainer that shifts targets by one token (EAGLE predicts the state / token at t+1 from t) must not shift across
a document boundary in a packed row: positions where document_ids[t] != document_ids[t+1] have no target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

PACK_OVERLONG = ("error", "truncate")


def _split_fields(batch: Sequence[dict[str, Any]]) -> tuple[list[str], list[str]]:
    if not batch:
        raise ValueError("cannot collate an empty batch")
    tensors = [k for k, v in batch[0].items() if isinstance(v, torch.Tensor)]
    others = [k for k in batch[0] if k not in tensors]
    for k in ("input_ids", "loss_mask"):
        if k not in tensors:
            raise ValueError(f"items lack a {k!r} tensor (found {sorted(batch[0])}); collate HiddenStatesDataset items")
    return tensors, others


def _pad_value(key: str, pad_token_id: int) -> int:
    return pad_token_id if key == "input_ids" else 0


@dataclass(frozen=True)
class PadCollator:
    """Pad every sample to the longest in the batch: tensors [B, T_max, ...]."""

    pad_token_id: int = 0
    """Value of input_ids at padded positions (use the tokenizer's pad id)."""
    pad_to_multiple_of: int | None = None
    """Round T_max up to a multiple of this (e.g. 8 or 64 for tensor-core friendly shapes)."""

    def __call__(self, batch: Sequence[dict[str, Any]]) -> dict[str, Any]:
        tensor_keys, other_keys = _split_fields(batch)
        lengths = torch.tensor([item["input_ids"].shape[0] for item in batch], dtype=torch.long)  # [B]
        t_max = int(lengths.max())
        if self.pad_to_multiple_of:
            t_max = -(-t_max // self.pad_to_multiple_of) * self.pad_to_multiple_of
        out: dict[str, Any] = {}
        for key in tensor_keys:
            first = batch[0][key]
            padded = first.new_full((len(batch), t_max, *first.shape[1:]), _pad_value(key, self.pad_token_id))
            for b, item in enumerate(batch):
                padded[b, : item[key].shape[0]] = item[key]
            out[key] = padded  # [B, T_max, ...]
        positions = torch.arange(t_max).expand(len(batch), t_max)  # [B, T_max]
        out["attention_mask"] = (positions < lengths[:, None]).long()  # [B, T_max]
        if "positions" in out:  # the target's own positions (an image run: M-RoPE's time stream)
            positions = out["positions"]
        out["position_ids"] = positions * out["attention_mask"]  # [B, T_max], 0 on padding
        out["lengths"] = lengths
        for key in other_keys:
            out[key] = [item[key] for item in batch]
        return out


@dataclass(frozen=True)
class PackCollator:
    """Pack whole samples back to back into rows of at most `max_tokens` tokens (first fit, in batch order).

    Returns, for R rows of S tokens (S = max_tokens, or the longest row when `pad_to_max` is off):
        <every tensor field>  [R, S, ...]
        attention_mask        [R, S]    1 on real tokens (padding only ever at the end of a row)
        position_ids          [R, S]    restart at 0 for every sample; 0 on padding
        document_ids          [R, S]    index in the batch of the sample a token belongs to; -1 on padding
        cu_seqlens            [D+1]     int32 sample boundaries over the real tokens in row-major order
                                        (`x[attention_mask.bool()]`), as flash-attn's varlen kernels take them
        max_seqlen            int       the longest sample
        sample_index          [D]       batch index of each packed sample, in cu_seqlens order
        lengths               [B]       tokens per sample, in batch order
    """

    max_tokens: int
    """Token budget of one row."""
    pad_token_id: int = 0
    """Value of input_ids at padded positions."""
    pad_to_max: bool = True
    """Pad every row to max_tokens (fixed shapes); off: pad to the longest row of the batch."""
    overlong: str = "error"
    """A sample longer than max_tokens: "error", or "truncate" to its first max_tokens tokens."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.overlong not in PACK_OVERLONG:
            raise ValueError(f"overlong must be one of {list(PACK_OVERLONG)}, got {self.overlong!r}")

    def plan(self, lengths: Sequence[int]) -> list[list[int]]:
        """Rows as lists of batch indices, first fit in order; every index appears in exactly one row."""
        rows: list[list[int]] = []
        free: list[int] = []
        for i, n in enumerate(lengths):
            n = min(n, self.max_tokens)
            for r, room in enumerate(free):
                if n <= room:
                    rows[r].append(i)
                    free[r] -= n
                    break
            else:
                rows.append([i])
                free.append(self.max_tokens - n)
        return rows

    def __call__(self, batch: Sequence[dict[str, Any]]) -> dict[str, Any]:
        tensor_keys, other_keys = _split_fields(batch)
        lengths = [item["input_ids"].shape[0] for item in batch]
        over = [(i, n) for i, n in enumerate(lengths) if n > self.max_tokens]
        if over and self.overlong == "error":
            raise ValueError(f"samples {[i for i, _ in over]} of the batch have {[n for _, n in over]} tokens, over "
                             f"the packing budget max_tokens={self.max_tokens}; raise max_tokens, set the dataset's "
                             "max_length, or pass overlong='truncate'")
        used = [min(n, self.max_tokens) for n in lengths]
        rows = self.plan(used)
        s = self.max_tokens if self.pad_to_max else max(sum(used[i] for i in row) for row in rows)

        out: dict[str, Any] = {}
        for key in tensor_keys:
            first = batch[0][key]
            out[key] = first.new_full((len(rows), s, *first.shape[1:]), _pad_value(key, self.pad_token_id))
        position_ids = torch.zeros(len(rows), s, dtype=torch.long)  # [R, S]
        document_ids = torch.full((len(rows), s), -1, dtype=torch.long)  # [R, S]
        seqlens, order = [], []
        for r, row in enumerate(rows):
            offset = 0
            for i in row:
                n = used[i]
                for key in tensor_keys:
                    out[key][r, offset: offset + n] = batch[i][key][:n]
                own = batch[i].get("positions")  # the target's own (an image run: M-RoPE's time stream)
                position_ids[r, offset: offset + n] = torch.arange(n) if own is None else own[:n]
                document_ids[r, offset: offset + n] = i
                offset += n
                seqlens.append(n)
                order.append(i)
        out["attention_mask"] = (document_ids >= 0).long()
        out["position_ids"] = position_ids
        out["document_ids"] = document_ids
        out["cu_seqlens"] = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
        out["max_seqlen"] = max(seqlens)
        out["sample_index"] = torch.tensor(order, dtype=torch.long)
        out["lengths"] = torch.tensor(used, dtype=torch.long)
        for key in other_keys:
            out[key] = [item[key] for item in batch]
        return out
