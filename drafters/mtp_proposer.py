"""MTP decoding in hsx's engine (speculative_config method "mtp"): the target's own MTP layers (drafters/mtp.py) in
EAGLE-3's row cache and loop (drafters/eagle3_proposer.py).

The cache holds, per row, entry p = (x_{p+1}, the target's last layer after its final norm at x_p) for every verified
p, fed to every MTP layer; draft 1 is MTP layer 0's output at the last verified entry; draft s + 1 feeds (draft s,
the carried state of step s) at the next position and reads MTP layer (s % L)'s output, as vLLM's
`spec_step_idx % num_mtp_layers`. Draft entries are rolled back when the target answers, as EAGLE-3's.
"""

from __future__ import annotations

import torch
from torch import nn

from drafters.base import runner_target
from drafters.eagle3_proposer import Eagle3Proposer
from drafters.mtp import MtpHead
from drafters.mtp_checkpoint import check_source
from extractor.facts import text_config


class _MtpDrafter(nn.Module):
    """What Eagle3Proposer's loop calls, over an MtpHead: fuse (the target's final norm on layer N) and decode."""

    def __init__(self, head: MtpHead, target_norm: nn.Module) -> None:
        super().__init__()
        self.head = head
        self.target_norm = target_norm

    def fuse(self, last: torch.Tensor) -> torch.Tensor:
        """[n, 1, H] the target's last layer, pre-norm -> [n, H] after its final norm (what vLLM's target returns)."""
        return self.target_norm(last[..., 0, :])

    def decode(self, input_ids, hidden, position_ids, attention_mask, cache) -> torch.Tensor:
        return self.head.decode(input_ids, hidden, position_ids, attention_mask, cache)  # [R, S, L, H]


class MtpProposer(Eagle3Proposer):
    """speculative_config method "mtp": the target's MTP layers draft k tokens (see the module docstring).
    `model_dir` holds them: the target's own folder (vLLM's default), a copy with tuned layers, or a `hsx
    train-drafter --kind mtp` checkpoint."""

    def __init__(self, model_dir: str | None, runner, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        target = runner_target(runner)
        head = MtpHead.from_folder(model_dir or runner.config.model, hf_config=text_config(runner.model.config),
                                   embed_tokens=target.embed_tokens, lm_head=target.lm_head, dtype=runner.dtype)
        if model_dir:  # another folder's MTP layers (shapes checked above): made for this target, or refused
            check_source(model_dir, runner.config.model, "speculative_config method 'mtp'")
        self.device = torch.device(runner.device)
        self.head = head.to(self.device)
        self.drafter = _MtpDrafter(self.head, target.norm.module).eval()
        self.state_dtype = runner.dtype
        n = int(target.num_hidden_layers)
        self.capture_layer_ids = (n,)
        self.k = int(num_speculative_tokens)
        self._vocab = int(runner.vocab_size)
        self._draft_ids = torch.arange(self._vocab, device=self.device)
        self.budget = int(runner.config.max_num_batched_tokens)
        self.start([])

    def draft_state(self, out: torch.Tensor, step: int) -> torch.Tensor:
        """out [B', L, H] every MTP layer's output -> draft `step`'s: layer step % L's (vLLM's spec_step_idx % L)."""
        return out[:, step % self.head.count]

    def draft_logits(self, h: torch.Tensor, step: int) -> torch.Tensor:
        return self.head.logits(h, step % self.head.count)
