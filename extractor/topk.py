"""The top-k target: what a trainer reads of the last layer N, kept in its place (`--target top_k:K`).

    TopK.of_model(model, k)   the loaded model's own output head (extractor.head: final norm, lm_head and the
                              family's logits transform; no copies), checked against one forward, for K tokens
    TopK(states) -> (ids, logprobs)   [..., H] pre-norm last-layer states -> [..., K] int32 token ids, best first,
                                      and float32 log-probabilities (log_softmax over the whole vocabulary)

The states go through the model's own modules — the norm, then lm_head in the model dtype, then the family's soft-cap
or scale, as its forward computes the logits — and log_softmax runs in float32, as a sampler reads them. Rows are done a few at a time so the [rows, V]
float32 logits stay within LOGITS_BUDGET_BYTES, whatever the chunk's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from connectors.header import TOPK_IDS_DTYPE, TOPK_LOGPROBS_DTYPE
from extractor.head import LogitsHead

LOGITS_BUDGET_BYTES = 256 << 20
"""Largest float32 logits block computed at once."""


@dataclass(frozen=True)
class TopK:
    head: LogitsHead
    k: int

    @classmethod
    def of_model(cls, model: torch.nn.Module, k: int) -> TopK:
        try:
            head = LogitsHead.of_model(model)
            head.check(model)
        except ValueError as e:
            raise ValueError(f"a top_k target applies the model's final norm and lm_head, and {e}; store the states "
                             "(--target states) and keep layer N instead") from None
        return cls(head, int(k))

    @torch.inference_mode()
    def __call__(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lead, h = states.shape[:-1], states.shape[-1]
        flat = states.reshape(-1, h)  # [n, H]
        vocab = self.head.lm_head.weight.shape[0]
        step = max(1, LOGITS_BUDGET_BYTES // (4 * vocab))
        ids = torch.empty((flat.shape[0], self.k), dtype=TOPK_IDS_DTYPE, device=states.device)  # [n, K]
        logprobs = torch.empty((flat.shape[0], self.k), dtype=TOPK_LOGPROBS_DTYPE, device=states.device)  # [n, K]
        for a in range(0, flat.shape[0], step):
            logits = self.head(flat[a:a + step]).float()  # [rows, V]
            top = torch.log_softmax(logits, dim=-1).topk(self.k, dim=-1)  # sorted, best first
            ids[a:a + step] = top.indices.to(TOPK_IDS_DTYPE)
            logprobs[a:a + step] = top.values
        return ids.reshape(*lead, self.k), logprobs.reshape(*lead, self.k)
