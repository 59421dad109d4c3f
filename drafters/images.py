"""Image tokens in a drafter's input: the target's merged input embeddings where its prompt held an image.

vLLM's EAGLE proposer feeds a drafter of a vision-language target the target's own input embeddings, which at image
tokens are the vision tower's output, not the image placeholder's embedding. Training (a multimodal run's stored
mm_embeds, training.dataset image_inputs "vision") and hsx's proposers do the same through one mechanism: the
drafter's token-embedding module is wrapped for one pass, its output replaced where a mask says.

    override_embeddings(embedding, mask, values)   context manager: during it, embedding(ids) of shape [..., H]
                                                   gives values[...] where mask[...] (both shaped like ids)
    shifted_overrides(overrides, shift)            (mask, values) [R, S(, H)] moved left by `shift`, as the unroll
                                                   moves the token ids (x_{t+1+s})
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def override_embeddings(embedding: nn.Module | None, mask: torch.Tensor | None,
                        values: torch.Tensor | None) -> Iterator[None]:
    if embedding is None or mask is None or values is None or not bool(mask.any()):
        yield
        return

    def hook(module, args, out):
        if out.shape[:-1] != mask.shape:
            raise RuntimeError(f"image embeddings for ids of shape {list(mask.shape)}, the embedding was asked for "
                               f"{list(out.shape[:-1])} (internal error)")
        return torch.where(mask[..., None], values.to(out.device, out.dtype), out)

    handle = embedding.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def shifted_overrides(overrides: tuple[torch.Tensor, torch.Tensor] | None, shift: int
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    if overrides is None:
        return None
    mask, values = overrides
    out_mask = torch.zeros_like(mask)
    out_values = torch.zeros_like(values)
    if shift < mask.shape[1]:
        out_mask[:, :mask.shape[1] - shift] = mask[:, shift:]
        out_values[:, :mask.shape[1] - shift] = values[:, shift:]
    return out_mask, out_values
