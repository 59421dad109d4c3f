"""The proposer base of the families drafting from the target's last post-norm state (Medusa, MLPSpeculator): the
engine observes layer N (pre-norm); the newest verified state of each row goes through the target's own final norm
and a subclass drafts from it.

    load_for_runner(cls, model_dir, runner, k)   a checkpoint checked against the runner's target, on its device
                                                 and dtype, with the target's final norm
    LastStateProposer                            extractor.proposers.Proposer over the newest state per row;
                                                 subclasses set drafter_class and define draft_steps
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from extractor.norm import FinalNorm
from extractor.proposers import Draft, Proposer


def load_for_runner(cls, model_dir: str, runner, num_speculative_tokens: int):
    """A drafter checkpoint checked against the target `runner` holds, on its device and dtype, and its final norm."""
    drafter = cls.from_pretrained(model_dir)
    if drafter.hidden_size != runner.hidden_size or drafter.vocab_size != runner.vocab_size:
        raise ValueError(f"the {cls.kind} drafter {model_dir} has hidden size {drafter.hidden_size} and vocabulary "
                         f"{drafter.vocab_size}, the target {runner.config.model} has {runner.hidden_size} and "
                         f"{runner.vocab_size}: it was trained for another model; train one on a run of this target")
    if not 1 <= num_speculative_tokens <= drafter.max_drafts:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} but the {cls.kind} drafter {model_dir} "
                         f"drafts 1 to {drafter.max_drafts} tokens; lower num_speculative_tokens or train a drafter "
                         "with more heads / stages")
    norm = FinalNorm.of_model(runner.model)  # the target's own, in its dtype on its device: nothing read or copied
    return drafter.to(runner.device, runner.dtype).eval().requires_grad_(False), norm


class LastStateProposer(Proposer):
    """A proposer that drafts from the newest verified state of each row: the target's last layer (pre-norm,
    observed), put through the target's final norm (`self.norm`). propose() picks the rows to draft for and hands
    their post-norm states to the subclass's `draft_steps`, then cuts each row's draft to its own k."""

    drafter_class: type
    """The Drafter subclass its checkpoints hold."""

    def __init__(self, model_dir: str, runner, num_speculative_tokens: int) -> None:
        self.drafter, self.norm = load_for_runner(self.drafter_class, model_dir, runner, num_speculative_tokens)
        self.capture_layer_ids = (int(runner.num_hidden_layers),)
        self.k = num_speculative_tokens
        self.device = runner.device
        self.rows: list[torch.Tensor | None] = []

    def start(self, contexts) -> None:
        self.rows = [None] * len(contexts)

    def join(self, contexts) -> None:
        self.rows += [None] * len(contexts)

    def observe(self, states) -> None:
        if len(states) != len(self.rows):
            raise RuntimeError(f"observe got states of {len(states)} rows, the batch has {len(self.rows)}")
        for b, s in enumerate(states):  # s: [n_b, 1, H]
            if s.shape[0]:
                self.rows[b] = s[-1, 0]

    def select(self, keep) -> None:
        self.rows = [self.rows[i] for i in keep]

    @torch.inference_mode()
    def propose(self, contexts, ks, params, generators):
        if len(contexts) != len(self.rows):
            raise RuntimeError(f"propose got {len(contexts)} rows, the proposer holds {len(self.rows)}: the engine "
                               "must call start/join/select for every change of its rows")
        rows = [b for b, k in enumerate(ks) if k > 0 and self.rows[b] is not None]  # asked, and with a state
        drafts = [Draft([]) for _ in contexts]
        if not rows:
            return drafts
        k_max = min(max(ks[b] for b in rows), self.k)
        x = self.norm(torch.stack([self.rows[b] for b in rows]))  # [B', H] post-norm
        steps = self.draft_steps(x, [contexts[b][-1] for b in rows], k_max, [params[b] for b in rows],
                                 [generators[b] for b in rows])
        for r, b in enumerate(rows):
            k = min(ks[b], k_max)
            q = [steps[j][1][r] for j in range(k)]
            drafts[b] = Draft([steps[j][0][r] for j in range(k)], torch.stack(q) if q[0] is not None else None)
        return drafts

    def draft_steps(self, x: torch.Tensor, last_tokens: list[int], k: int, params: Sequence, generators: Sequence
                    ) -> list[tuple[list[int], list]]:
        """k draft positions for rows with post-norm states x [B', H] and newest tokens `last_tokens`: per
        position, extractor.sampling.sample_with_probs' (tokens, probs) over the rows."""
        raise NotImplementedError
