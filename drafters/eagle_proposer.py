"""EAGLE decoding in hsx's engine (speculative_config method "eagle"): EAGLE-3's row cache and loop
(drafters/eagle3_proposer.py) over an EAGLE head, whose "fused" state is the target's last layer through its final
norm and whose read-out is the target's own lm_head."""

from __future__ import annotations

from drafters.base import runner_target
from drafters.eagle import EagleDrafter
from drafters.eagle3_proposer import Eagle3Proposer


class EagleProposer(Eagle3Proposer):
    """speculative_config method "eagle": an EAGLE head drafts k tokens from the target's last-layer features (its
    last layer through its final norm), read out with the target's own lm_head and embeddings, as vLLM shares them."""

    @classmethod
    def load(cls, model_dir: str, runner) -> EagleDrafter:
        # the runner's own lm_head, shared (built in its dtype, on its device: no second copy); a copy of its norm
        return EagleDrafter.from_pretrained(model_dir, target=runner_target(runner))
