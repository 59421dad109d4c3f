"""P-EAGLE (speculators' `peagle`): EAGLE-3's head, drafting all k tokens in one forward.

    PEagleConfig      EAGLE-3's options + mask_token_id, the depth sampling (COD) ratios; ttt_steps = the depths
    PEagleDrafter     Eagle3Drafter + `mask_hidden` [1, 1, A*H] (a learned stand-in for the aux states of a position
                      not verified yet); kind "peagle"; the speculators peagle checkpoint
    FAMILY            P-EAGLE in the drafter registry (EAGLE-3's FEATURES)
    (its proposer, PEagleProposer, is drafters/peagle_proposer.py: per step ONE drafter forward over the newly
    verified entries and k-1 mask entries; the last verified entry's output drafts token 1, mask entry d token d+1)

Depth 0 of chain t is EAGLE-3's step 0: (fc(aux of x_t), embedding of x_{t+1}) at position t, predicting x_{t+2}.
Depth d >= 1: (fc(mask_hidden), embedding of mask_token_id) at position t+d, predicting x_{t+2+d} — it reads nothing
the drafter produced, so every depth is computed in one forward at decoding. Its attention sees depth 0 of positions
<= t of the same document and its own chain's earlier depths (EAGLE-3's test-time-training mask, drafters/ttt.py).

Training (speculators' COD sampling): every chain trains depth 0; depth d counts a nested random subset of chains, a
fraction max(0.7^d, 0.2); the loss is the mean over every sampled (chain, depth), so depth 0 weighs most (one uniform draw per chain, kept while below the depth's ratio, so a chain kept at d is kept
at every earlier depth). The forward runs depth d only on the chains trained at d or deeper (drafters/ttt.py's
needed_chains), so the draft layers' compute and memory fall with the sampling fractions (their attention spans each
document's keys up to its last sampled chain); the loss and gradients are those of running every chain at every
depth.

Checkpoint (what speculators' PEagleDraftModel.from_pretrained loads, and vLLM's eagle3 method with
parallel_drafting): EAGLE-3's config.json with speculators_model_type "peagle", architectures ["PEagleSpeculator"],
mask_token_id, norm_before_fc / fc_norm / norm_output false, embed_requires_grad false (hsx keeps the target's
embeddings frozen); EAGLE-3's weights plus `mask_hidden` (always written: a checkpoint without it loads in
speculators with uninitialised memory there and no warning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from drafters.base import resolve_mask_token_id, speculators_num_speculative_tokens
from drafters.eagle3 import FEATURES, Eagle3Config, Eagle3Drafter
from drafters.registry import Family

SPECULATORS_MODEL_TYPE = "peagle"
ARCHITECTURE = "PEagleSpeculator"


@dataclass(frozen=True)
class PEagleConfig(Eagle3Config):
    """P-EAGLE's options: EAGLE-3's, with ttt_steps = the depths trained (the most tokens drafted per step)."""

    ttt_steps: int = 8
    """Depths trained (speculators' num_depths): the head drafts up to this many tokens in one forward."""
    mask_token_id: int | None = None
    """The token depths >= 1 read (None: the target's pad token, else its last vocabulary id)."""
    down_sample_ratio: float = 0.7
    """COD: depth d keeps a fraction max(ratio**d, down_sample_ratio_min) of the chains in the loss."""
    down_sample_ratio_min: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.down_sample_ratio <= 1 or not 0 < self.down_sample_ratio_min <= 1:
            raise ValueError("down_sample_ratio and down_sample_ratio_min must be in (0, 1]")


class PEagleDrafter(Eagle3Drafter):
    """EAGLE-3 with a mask state: every depth in one parallel forward (see the module docstring)."""

    kind = "peagle"
    speculators_model_type = SPECULATORS_MODEL_TYPE
    architecture = ARCHITECTURE
    config_class = PEagleConfig

    def __init__(self, config: PEagleConfig, layer_config, aux_layer_ids, target_hidden_size: int,
                 num_speculative_tokens: int = 3, verifier: str = "", verifier_architectures=()) -> None:
        super().__init__(config, layer_config, aux_layer_ids, target_hidden_size, num_speculative_tokens, verifier,
                         verifier_architectures)
        self.mask_token_id = resolve_mask_token_id(config.mask_token_id, layer_config)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, len(self.aux_layer_ids) * self.target_hidden_size))

    @classmethod
    def _options_from_checkpoint(cls, doc: dict[str, Any]) -> dict[str, Any]:
        return {"mask_token_id": doc.get("mask_token_id")}

    def mask_state(self) -> torch.Tensor:
        """[H] the fused stand-in state of a depth >= 1 entry: fc(mask_hidden)."""
        return self.fc(self.mask_hidden.to(self.fc.weight.dtype)).reshape(-1)

    def step_inputs(self, step: int, ids: torch.Tensor, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth 0 as EAGLE-3's step 0; depth d >= 1 reads (mask token, fc(mask_hidden)), nothing the drafter
        produced."""
        if step == 0:
            return ids, previous
        return torch.full_like(ids, self.mask_token_id), self.mask_state().expand_as(previous)

    def trained_chains(self, valid: torch.Tensor, step: int) -> torch.Tensor:
        """COD: depth `step` keeps chains whose uniform draw (one per chain and batch) is below its ratio."""
        if step == 0:
            self._draw = torch.rand(valid.shape, device=valid.device)
            return valid
        ratio = max(self.config.down_sample_ratio ** step, self.config.down_sample_ratio_min)
        return valid & (self._draw < ratio)

    def combine_step_losses(self, terms) -> torch.Tensor:
        """The mean over every sampled (chain, depth), as speculators' loss over its sampled positions: depth 0 (all
        chains) weighs most, a depth in proportion to the chains COD kept there."""
        total = sum(n for _, _, n in terms)
        return sum(ce * n for _, ce, n in terms) / total

    def checkpoint_config(self) -> dict[str, Any]:
        doc = super().checkpoint_config()
        doc.update(mask_token_id=self.mask_token_id, norm_before_fc=False, fc_norm=False, norm_output=False,
                   embed_requires_grad=False)
        return doc


FAMILY = Family(name="peagle", description="a P-EAGLE (speculators peagle) checkpoint",
                drafter="drafters.peagle:PEagleDrafter", proposer_class="drafters.peagle_proposer:PEagleProposer",
                config_matches=lambda config: config.get("speculators_model_type") == SPECULATORS_MODEL_TYPE,
                config_k=speculators_num_speculative_tokens, options=("draft_vocab_size", "ttt_steps"),
                parallel_of="eagle3", parallel=True, features=FEATURES)
"""P-EAGLE in the registry (pyproject.toml's hsx.drafters entry point `peagle`)."""
