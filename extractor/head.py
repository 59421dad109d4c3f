"""The target's output head as its own forward computes it: final norm, lm_head, then whatever the family does to
the logits (Gemma's soft-cap, Granite's and Falcon-H1's scales, Cohere's logit scale).

    logits_transform(config)     the family's transform of lm_head's output, from its config (TargetHead applies it
                                 too, so drafters train on the distribution the target serves)
    LogitsHead.of_model(model)   the loaded model's own norm and lm_head (shared, not copied) and its logits transform
    head(states)                 [..., H] pre-norm last-layer states -> [..., V] logits, in the model's dtype
    head.check(model)            one short forward of the model: the head must give the model's own logits from its
                                 pre-norm last layer, or the family transforms them in a way hsx does not know (refused)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from extractor.facts import text_config
from extractor.layers import find_decoder
from extractor.norm import FinalNorm

MULTIPLIED_LOGITS_SCALING = ("hyperclovax",)
"""Families whose logits_scaling multiplies the logits (Granite's, the others that carry it, divide by it)."""
LOGIT_SCALE_FAMILIES = ("cohere", "cohere2", "cohere2_moe")
"""Families whose forward multiplies the logits by config.logit_scale (MPT's config carries one it never applies)."""


def logits_transform(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the family's CausalLM forward does to lm_head's output, read from its text config (`config`: a
    PretrainedConfig, or a loaded model, whose config is read), in the forward's own order of operations (so the
    result is bit-identical): Gemma's soft-cap, Granite's logits_scaling (a divide; HyperCLOVA X's multiplies),
    Falcon-H1's lm_head_multiplier and Cohere's logit_scale (multiplies); identity for most families. A loaded
    model's LogitsHead.check proves it."""
    if isinstance(config, torch.nn.Module):
        config = config.config
    config = text_config(config)
    kind = str(getattr(config, "model_type", ""))
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        return lambda x: torch.tanh(x / cap) * cap
    scaling = getattr(config, "logits_scaling", None)
    if scaling not in (None, 1, 1.0):
        if kind.startswith(MULTIPLIED_LOGITS_SCALING):
            return lambda x: x * scaling
        return lambda x: x / scaling
    multiplier = getattr(config, "lm_head_multiplier", None)
    if isinstance(multiplier, (int, float)) and not isinstance(multiplier, bool) and multiplier != 1:
        return lambda x: x * multiplier
    scale = getattr(config, "logit_scale", None)
    if kind in LOGIT_SCALE_FAMILIES and isinstance(scale, (int, float)) and scale != 1:
        return lambda x: x * scale
    return _identity


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def has_logits_transform(config: Any) -> bool:
    """Whether the family transforms its logits (soft-cap, scaling): softmax over raw lm_head outputs is then not
    the distribution the target serves."""
    return logits_transform(config) is not _identity


@dataclass(frozen=True)
class LogitsHead:
    norm: torch.nn.Module
    """The model's final norm module (e.g. model.norm)."""
    lm_head: torch.nn.Module
    """The model's output embeddings, [V, H]."""
    transform: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> LogitsHead:
        return cls(FinalNorm.of_model(model).module, model.get_output_embeddings(), logits_transform(model))

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        return self.transform(self.lm_head(self.norm(states)))

    @torch.inference_mode()
    def check(self, model: torch.nn.Module) -> None:
        """ValueError unless this head turns the model's pre-norm last layer into the model's own logits (a short
        forward of a few token ids)."""
        n = int(text_config(model.config).num_hidden_layers)
        last = find_decoder(model, n)[2][-1]
        seen: list[torch.Tensor] = []
        handle = last.register_forward_hook(lambda m, a, out: seen.append(out[0] if isinstance(out, tuple) else out))
        device = self.lm_head.weight.device
        vocab = int(self.lm_head.weight.shape[0])
        ids = (torch.arange(6, device=device)[None] * 7919 + 11) % vocab  # [1, 6], arbitrary in-vocabulary ids
        try:
            expected = model(input_ids=ids, use_cache=False).logits  # [1, 6, V]
        finally:
            handle.remove()
        got = self(seen[-1])
        if got.shape != expected.shape or not torch.allclose(got.float(), expected.float(), rtol=1e-4, atol=1e-4):
            diff = (got.float() - expected.float()).abs().max().item() if got.shape == expected.shape else "shape"
            raise ValueError(f"hsx cannot reproduce this {type(model).__name__}'s logits from its last layer through "
                             f"its final norm and lm_head (max difference {diff}): the model transforms them in a way "
                             "hsx does not know")
