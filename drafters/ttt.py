"""Test-time training (EAGLE-3 paper, sec. 3): the pieces of the unrolled training forward that EAGLE-3, EAGLE and
P-EAGLE share.

    shift_left(x, shift)          x [R, S, ...] -> out[:, t] = x[:, t + shift], zeros past the end
    ttt_mask(document_ids, step)  [R, 1, S, S*(step+1)] the attention of unroll step `step` over the keys of steps
                                  0..step: step 0's causal within the document, each later step's own diagonal
    one_document_per_row(batch)   a packed DrafterBatch rewritten one document per row when that makes attention
                                  smaller (documents never see each other, so no chain's computation changes)
"""

from __future__ import annotations

import torch

from drafters.base import DrafterBatch


def shift_left(x: torch.Tensor, shift: int) -> torch.Tensor:
    """x [R, S, ...] -> out[:, t] = x[:, t + shift], zeros past the end."""
    out = torch.zeros_like(x)
    if shift < x.shape[1]:
        out[:, :x.shape[1] - shift] = x[:, shift:]
    return out


def ttt_mask(document_ids: torch.Tensor, step: int) -> torch.Tensor:
    """[R, 1, S, S*(step+1)] bool: step `step`'s queries over the keys of steps 0..step, concatenated. Step 0's
    keys: causal within the document; each later step's: the chain's own key only (the diagonal)."""
    r, s = document_ids.shape
    ar = torch.arange(s, device=document_ids.device)
    eye = (ar[:, None] == ar[None, :]).expand(r, s, s)  # [R, S, S]
    causal = (ar[:, None] >= ar[None, :])[None] & (document_ids[:, :, None] == document_ids[:, None, :])
    return torch.cat([causal | eye] + [eye] * step, dim=-1)[:, None]


def one_document_per_row(batch: DrafterBatch) -> DrafterBatch:
    """A packed batch [R, S, ...] rewritten as one document per row [G, L, ...] (L = the longest document, padding
    after it), when that makes the attention smaller (G*L^2 < R*S^2). Documents never see each other, so every
    chain's computation is unchanged; the TTT attention of a long packed row is mostly masked otherwise."""
    valid = batch.document_ids >= 0  # [R, S]
    starts = valid & (batch.position_ids == 0)  # a sample starts at position 0 (PackCollator)
    groups = int(starts.sum())
    if groups == 0:
        return batch
    length = int(batch.position_ids[valid].max()) + 1
    r, s = batch.input_ids.shape
    if groups * length * length >= r * s * s:
        return batch
    group = (starts.flatten().cumsum(0) - 1).reshape(r, s)[valid]  # [N] row of each real token
    offset = batch.position_ids[valid]  # [N] its place in the row

    def scatter(x: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((groups, length, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
        out[group, offset] = x[valid]
        return out

    topk = None if batch.target_topk is None else tuple(scatter(t, 0) for t in batch.target_topk)
    return DrafterBatch(scatter(batch.input_ids, 0), scatter(batch.hidden_states, 0), scatter(batch.loss_mask, False),
                        scatter(batch.position_ids, 0), scatter(torch.zeros_like(batch.document_ids), -1),
                        batch.layer_ids, topk)
