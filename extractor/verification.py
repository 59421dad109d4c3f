"""Verification: which drafted tokens the target keeps, from one target forward over last token + drafts.

    verify(logits, draft, params, generator) -> (tokens to emit, number of drafts accepted)

logits [n + 1, V] are the target's at the last accepted token and at each of the n drafts. Greedy: keep the longest
prefix of the draft equal to the target's argmax, then emit the target's own token there (the correction, or the
bonus token after a fully accepted draft). Temperature > 0: speculative rejection sampling — keep draft token x with
probability min(1, p(x) / q(x)); on the first rejection emit a sample of normalize(max(0, p - q)); after a full
acceptance, a sample of p. q = one-hot for deterministic proposers (ngram). Either way the emitted tokens follow
the target's own distribution p (greedy: its argmax), so speculation never changes what is generated in law.
"""

from __future__ import annotations

import torch

from extractor.proposers import Draft
from extractor.sampling import SamplingParams, sampling_probs


def verify(logits: torch.Tensor, draft: Draft, params: SamplingParams,
           generator: torch.Generator | None) -> tuple[list[int], int]:
    n = len(draft.token_ids)
    assert logits.shape[0] == n + 1, (logits.shape, n)
    if params.greedy:
        target = logits.argmax(-1).tolist()  # [n + 1]
        a = 0
        while a < n and draft.token_ids[a] == target[a]:
            a += 1
        return draft.token_ids[:a] + [target[a]], a
    return _rejection_sample(logits, draft, params, generator)


def _rejection_sample(logits, draft: Draft, params: SamplingParams, generator) -> tuple[list[int], int]:
    out: list[int] = []
    for i, x in enumerate(draft.token_ids):
        p = sampling_probs(logits[i], params)  # [V]
        if draft.probs is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        else:
            q = draft.probs[i].float().cpu()
        if q[x] <= 0:
            raise RuntimeError(f"the proposer drafted token {x} at position {i} with probability 0 (internal error "
                               "in the proposer: drafts must be drawn from the probabilities it returns)")
        u = float(torch.rand((), generator=generator))
        if u < min(1.0, float(p[x] / q[x])):
            out.append(x)
            continue
        residual = (p - q).clamp(min=0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out, i
    bonus = sampling_probs(logits[len(draft.token_ids)], params)
    out.append(int(torch.multinomial(bonus, 1, generator=generator)))
    return out, len(draft.token_ids)
