"""What the families drafting from the target's last post-norm state share (Medusa, MLPSpeculator): which positions
a draft trains on, the target's logits there, the per-draft loss, and the checks of their options and runs.

    TARGETS                                  "target" (distillation) | "tokens" (hard labels): a config's `targets`
    predicted_mask(batch, shift)             [R, S] the token `shift` after x_t is trained and in x_t's sample
    TeacherLogits.of(batch, post, target, chunk)   the target's logits at the positions whose next token is trained
    head_loss(hidden, readout, teacher, tokens, targets, chunk)   one draft position's mean loss (soft or hard
                                             labels) and argmax
    drop_draft_count(options, key, k, ...)   a family's own name for k (medusa_num_heads, n_predict) checked against k
    check_run_fits(run_spec, target)         the run's states are as wide as the target's lm_head

Their proposer base (the newest verified state per row) is drafters/last_state_proposer.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from drafters.base import DrafterBatch, TargetHead
from drafters.memory import chunked_argmax, cross_entropy

TARGETS = ("target", "tokens")


def predicted_mask(batch: DrafterBatch, shift: int) -> torch.Tensor:
    """[R, S] bool: the token `shift` after x_t is in x_t's sample and has loss_mask 1 (what a draft at t trains on)."""
    return batch.same_document(shift) & batch.shifted(batch.loss_mask, shift, False)


@dataclass
class TeacherLogits:
    """The target's logits at the positions whose next token is trained (the only ones a draft's target is read
    from), not [R, S, V] for the whole batch; with --ce-chunk-tokens not even [n, V]: only those positions' states
    [n, H] and greedy tokens are kept, and the logits are computed where a chunk reads them."""

    index: torch.Tensor  # [R, S] int64: row n of position (r, s), -1 where none was computed
    greedy: torch.Tensor  # [n] int64 the target's token at each row
    logits: torch.Tensor | None  # [n, V] float32 (no chunking)
    states: torch.Tensor | None  # [n, H] the post-norm states (chunking)
    lm_head: torch.Tensor | None  # [V, H] (chunking)
    target: TargetHead | None = None
    """Whose family's logits transform the chunked path applies (soft-cap, scaling)."""

    @classmethod
    def of(cls, batch: DrafterBatch, post: torch.Tensor, target: TargetHead, chunk: int = 0) -> TeacherLogits:
        """post [R, S, H] the target's post-norm last state of every position; chunk: --ce-chunk-tokens."""
        needed = predicted_mask(batch, 1)  # [R, S] x_{s+1} trained and in x_s's sample
        index = torch.full(needed.shape, -1, dtype=torch.long, device=needed.device)
        index[needed] = torch.arange(int(needed.sum()), device=needed.device)
        head = target.lm_head.to(post.device, post.dtype)
        with torch.no_grad():
            states = post[needed]  # [n, H]
            if not chunk:
                logits = target.transformed((states @ head.T).float())  # [n, V]
                return cls(index, logits.argmax(-1), logits, None, None)
            greedy = chunked_argmax(lambda part: part @ head.T, states, chunk)  # the transforms keep the order
        return cls(index, greedy, None, states, head, target)

    def rows(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """[m] the teacher's rows of positions (rows[i], cols[i]) (each one whose next token is trained)."""
        index = self.index[rows, cols]
        assert bool((index >= 0).all()), "a draft target read at a position whose next token is not trained"
        return index

    def distribution(self, where: torch.Tensor):
        """A teacher for drafters.memory.cross_entropy: chunk `index` of the rows `where` -> the target's softmax."""
        return functools.partial(self._softmax, where)

    def _softmax(self, where: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        rows = where[index]
        if self.logits is not None:
            return F.softmax(self.logits[rows], dim=-1)
        logits = (self.states[rows] @ self.lm_head.T).float()
        return F.softmax(self.target.transformed(logits) if self.target is not None else logits, dim=-1)


def head_loss(hidden: torch.Tensor, readout, teacher, tokens: torch.Tensor, targets: str,
              chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft position's mean loss over n positions and its argmax [n]: readout(hidden [n, ...]) -> logits
    [n, V] against the target's distribution (teacher: TeacherLogits.distribution of the rows; soft labels:
    cross-entropy, = KL up to the teacher's entropy) or the tokens [n] (hard labels); the logits `chunk` rows at a
    time with --ce-chunk-tokens."""
    if hidden.shape[0] == 0:  # nothing to learn from this draft position: a zero that keeps the graph
        return readout(hidden).sum() * 0.0, tokens.new_zeros(0)
    total, best = cross_entropy(hidden, readout, tokens if targets == "tokens" else teacher, chunk=chunk)
    return total / hidden.shape[0], best


def drop_draft_count(options: dict[str, Any], key: str, k: int, family_has: str) -> None:
    """Remove `key` (the family's own name for its number of drafts) from `options`: ValueError unless it equals
    num_speculative_tokens `k`, which the config is then built from."""
    given = options.pop(key, k)
    if given != k:
        raise ValueError(f"{key}={given} and num_speculative_tokens={k} disagree; {family_has} per draft: pass only "
                         "num_speculative_tokens")


def check_run_fits(run_spec: Any, target: TargetHead) -> None:
    """The run's states must come from a model of the target's width (else the run is from another model)."""
    hidden = getattr(run_spec, "hidden_size", None)
    if hidden is not None and int(hidden) != target.hidden_size:
        raise ValueError(f"the run's states are {hidden} wide but the target's lm_head is {target.hidden_size}: the "
                         f"run was extracted from another model than the target given (--model)")
