"""Batches under a token budget, grouped by length.

Requests are sorted by length so a batch pads little; a batch holds at most `max_num_seqs` rows and, padded,
at most `max_num_batched_tokens` tokens. A prompt longer than the budget goes alone and is prefilled in chunks of
`chunk_size` columns. Prompt-only requests and generating ones never share a batch (the former can stop the forward
early and skip the lm_head).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Batch(Generic[T]):
    items: list[T]
    max_len: int
    chunk_size: int
    """Columns per forward: max_len when the whole padded batch fits the budget."""


def plan_batches(items: Sequence[T], length: Callable[[T], int], group: Callable[[T], object],
                 max_num_batched_tokens: int, max_num_seqs: int) -> list[Batch[T]]:
    batches: list[Batch[T]] = []
    groups: dict[object, list[T]] = {}
    for item in items:
        groups.setdefault(group(item), []).append(item)
    for members in groups.values():
        members = sorted(members, key=length, reverse=True)
        i = 0
        while i < len(members):
            longest = length(members[i])
            if longest >= max_num_batched_tokens:
                batches.append(Batch([members[i]], longest, max_num_batched_tokens))
                i += 1
                continue
            rows = max(1, min(max_num_seqs, max_num_batched_tokens // longest))
            batches.append(Batch(members[i:i + rows], longest, longest))
            i += rows
    return batches
