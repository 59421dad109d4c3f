"""Medusa decoding in hsx's engine (speculative_config method "medusa"): head j's choice from the newest verified
state is draft j."""

from __future__ import annotations

from drafters.last_state_proposer import LastStateProposer
from drafters.medusa import MedusaDrafter
from extractor.sampling import sample_with_probs


class MedusaProposer(LastStateProposer):
    """speculative_config method "medusa": head j's choice from the newest verified state is draft j.

    The engine observes the last layer (pre-norm); the newest observed state is that of contexts[b][-2], whose
    heads predict the tokens after contexts[b][-1] (the target's own token). A row with no observed state yet
    (a one-token prompt) gets no draft."""

    drafter_class = MedusaDrafter

    def draft_steps(self, x, last_tokens, k, params, generators):
        logits = self.drafter(x, k)  # [k, B', V]: every head reads the same state
        return [sample_with_probs(logits[j], params, generators) for j in range(k)]
