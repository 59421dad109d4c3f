"""Test-time training (EAGLE-3 paper, sec. 3): the pieces of the unrolled training forward that EAGLE-3, EAGLE and
P-EAGLE share.

    shift_left(x, shift)          x [R, S, ...] -> out[:, t] = x[:, t + shift], zeros past the end
    needed_chains(trained)        per step the chains to run: those trained at that step or a later one (nested)
    unroll_chains(decode, ...)    the unroll itself: step 0 over every position of the packed rows, step s >= 1 over
                                  the chains it needs only, attention through drafters.attention.TTTAttention (each
                                  step sees step 0's keys of its document up to the chain's position and the chain's
                                  own keys of steps 1..s, with no [T, T] term)
    UnrollStep.take(rows, cols)   a step's outputs at packed positions

Which chains a step runs never changes a trained chain's result: chain t's step s reads only step 0's keys and its own
earlier steps, and a chain trained at step s (or later) is run at every step before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from drafters.attention import TTTAttention
from drafters.images import override_embeddings, shifted_overrides


def shift_left(x: torch.Tensor, shift: int) -> torch.Tensor:
    """x [R, S, ...] -> out[:, t] = x[:, t + shift], zeros past the end."""
    out = torch.zeros_like(x)
    if shift < x.shape[1]:
        out[:, :x.shape[1] - shift] = x[:, shift:]
    return out


def needed_chains(trained: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """trained: per step s a [R, S] bool of the chains whose draft s the loss counts -> per step the flat positions
    to run (None for step 0: every position, whose keys every later step reads): those trained at s or later."""
    out: list[torch.Tensor | None] = []
    later = torch.zeros_like(trained[-1])
    for mask in reversed(trained[1:]):
        later = later | mask
        out.append(later.flatten().nonzero().squeeze(1))
    return [None] + out[::-1]


@dataclass
class UnrollStep:
    """One unroll step's outputs: hidden [n, H] for `chains` (flat positions, ascending; None: every position)."""

    hidden: torch.Tensor
    chains: torch.Tensor | None
    row_length: int

    def take(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """[m, H] the outputs at packed positions (rows, cols), each one this step ran."""
        flat = rows * self.row_length + cols
        if self.chains is not None:
            at = torch.searchsorted(self.chains, flat).clamp(max=max(self.chains.numel() - 1, 0))
            if self.chains.numel() == 0 or not torch.equal(self.chains[at], flat):
                raise ValueError("UnrollStep.take: a position this step did not run (its chains come from "
                                 "needed_chains over the trained positions)")
            flat = at
        return self.hidden[flat]

    def grid(self, rows: int) -> torch.Tensor:
        """[R, S, H] (zeros at chains not run)."""
        full = self.hidden.new_zeros(rows * self.row_length, self.hidden.shape[-1])
        full = full.index_put((self.chains,), self.hidden) if self.chains is not None else self.hidden
        return full.view(rows, self.row_length, -1)


StepInputs = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(step, token ids [n], previous step's outputs [n, H]) -> the step's (token ids, hidden) [n], [n, H]."""


def unroll_chains(decode, first_hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  document_ids: torch.Tensor, chains: list[torch.Tensor | None],
                  step_inputs: StepInputs | None = None,
                  images: tuple[nn.Module, torch.Tensor, torch.Tensor] | None = None) -> list[UnrollStep]:
    """The unroll: step s embeds x_{t+1+s} at position t+s with the previous step's output of chain t (step 0:
    first_hidden [R, S, H]); `step_inputs` may replace both (P-EAGLE's mask entries). chains[s]: the flat positions
    step s runs (None: all; nested; step 0 always all). decode(ids, hidden, positions, attention_mask, cache) is the
    family's draft-layer pass. Steps after one that runs no chain are not run. `images` (the drafter's token
    embedding, mask [R, S], embeddings [R, S, H]): where x_{t+1+s} is an image token, its embedding is the target's
    merged one (drafters.images)."""
    r, s_len = input_ids.shape
    attn = TTTAttention(document_ids)
    out: list[UnrollStep] = []
    prev = first_hidden.reshape(r * s_len, -1)
    prev_chains: torch.Tensor | None = None
    for s, these in enumerate(chains):
        if these is not None and these.numel() == 0:
            break
        attn.begin(s, these)
        ids = shift_left(input_ids, 1 + s).flatten()  # x_{t+1+s}
        pos = (position_ids + s).flatten()
        if these is None:
            hidden = prev
        else:
            ids, pos = ids[these], pos[these]
            hidden = prev[these] if prev_chains is None else prev[torch.searchsorted(prev_chains, these)]
        shape = (r, s_len) if these is None else (1, these.numel())
        override = None
        if images is not None:  # x_{t+1+s}'s image embeddings, moved and picked as the ids are
            mask, values = shifted_overrides(images[1:], 1 + s)
            mask, values = mask.flatten(), values.reshape(r * s_len, -1)
            if these is not None:
                mask, values = mask[these], values[these]
            override = (mask.view(shape), values.reshape(*shape, -1))
        if step_inputs is not None:
            given = ids
            ids, hidden = step_inputs(s, ids, hidden)
            if override is not None:  # only where the step still reads x_{t+1+s} (not P-EAGLE's mask entries)
                override = (override[0] & (ids == given).view(shape), override[1])
        with override_embeddings(images[0] if images is not None else None, *(override or (None, None))):
            result = decode(ids.view(shape), hidden.reshape(*shape, -1), pos.view(shape), attn, attn)
        prev, prev_chains = result.reshape(-1, result.shape[-1]), these
        out.append(UnrollStep(prev, these, s_len))
    return out
