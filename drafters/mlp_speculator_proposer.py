"""MLPSpeculator decoding in hsx's engine (speculative_config method "mlp_speculator"): stage 0 reads the newest
verified state and the newest token, each later stage the previous stage's state and the token it drafted."""

from __future__ import annotations

import torch

from drafters.last_state_proposer import LastStateProposer
from drafters.mlp_speculator import MLPSpeculatorDrafter
from extractor.sampling import sample_with_probs


class MLPSpeculatorProposer(LastStateProposer):
    """speculative_config method "mlp_speculator": stage 0 reads the newest verified state (of contexts[b][-2])
    and the newest token contexts[b][-1]; stage i+1 the state of stage i and the token it drafted."""

    drafter_class = MLPSpeculatorDrafter

    def draft_steps(self, x, last_tokens, k, params, generators):
        state = self.drafter.initial_state(x)  # [B', H]
        tokens = torch.tensor(last_tokens, dtype=torch.long, device=self.device)  # [B']
        steps = []
        for i in range(k):
            state, logits = self.drafter.stage(i, state, tokens)  # [B', D], [B', V]
            steps.append(sample_with_probs(logits, params, generators))
            tokens = torch.tensor(steps[-1][0], dtype=torch.long, device=self.device)
        return steps
