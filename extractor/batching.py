"""Batches under a token budget, grouped by length, cut where padding costs more than another forward.

Requests are sorted by length (longest first) and split into runs of neighbours; a batch holds at most
`max_num_seqs` rows and, padded to its longest row, at most `max_num_batched_tokens` tokens. Where to cut is chosen
to minimise padded tokens + `forward_cost_tokens` per forward (an exact dynamic programme over the sorted lengths):
a batch of rows 2048, 1100, 900 pads 2046 tokens, so on a device where a forward costs as little as 64 tokens' work
it is cheaper to run them apart. A prompt longer than the budget goes alone and is prefilled in chunks of
`chunk_size` columns. The engine plans prompt-only requests this way (they can stop the forward early and skip the
lm_head); generating ones are batched continuously instead (extractor/llm.py), each prefill group admitted being
the first batch of this plan over the longest waiting requests (first_batch_rows).

Packed (plan_packed, where the runner packs: extractor.packing): no padding at all, so a batch is simply as many
prompts as fit end to end (at most `max_num_seqs`) in the budget, or in PACKED_FORWARD_TOKENS where the device runs
smaller forwards faster (a CPU): best-fit decreasing, each prompt, longest first, into the fullest batch it still
fits; a prompt that long goes alone (over the budget: prefilled in chunks).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")

FORWARD_COST_TOKENS = {"cpu": 64, "cuda": 512}
"""Fixed cost of one forward pass in tokens' worth of work, per device type: a CPU is near full speed on one short
row; a GPU needs hundreds of tokens per forward before the weights stop dominating."""
DEFAULT_FORWARD_COST_TOKENS = 256
PACKED_FORWARD_TOKENS = {"cpu": 2048}
"""Tokens a packed forward is filled to, per device type, where that is below the budget: a CPU runs a decoder fastest
on forwards of 1-2k tokens (its caches: 12% fewer tokens/s at 8k, measured with benchmarks/bench_extraction.py's
small shape); a GPU fills the whole budget."""


@dataclass
class Batch(Generic[T]):
    items: list[T]
    max_len: int
    chunk_size: int
    """Columns per forward: max_len when the whole padded batch fits the budget; packed, the batch's token count."""
    packed: bool = False
    """The items' prompts run end to end in one row (plan_packed); otherwise padded to max_len."""

    def padded_tokens(self, length: Callable[[T], int]) -> int:
        """Tokens the forward computes that belong to no prompt."""
        return 0 if self.packed else sum(self.max_len - length(m) for m in self.items)


def plan_batches(items: Sequence[T], length: Callable[[T], int], max_num_batched_tokens: int, max_num_seqs: int,
                 forward_cost_tokens: int = DEFAULT_FORWARD_COST_TOKENS) -> list[Batch[T]]:
    members = sorted(items, key=length, reverse=True)
    lengths = [length(m) for m in members]
    batches: list[Batch[T]] = []
    for i, j in _cuts(lengths, max_num_batched_tokens, max_num_seqs, forward_cost_tokens):
        longest = lengths[i]
        batches.append(Batch(members[i:j], longest, min(longest, max_num_batched_tokens)))
    return batches


def plan_prompt_only(items: Sequence[T], length: Callable[[T], int], max_num_batched_tokens: int, max_num_seqs: int,
                     *, packed: bool, device_type: str, packed_limit: int | None = None) -> list[Batch[T]]:
    """The engine's forwards for prompt-only items: packed end to end (plan_packed) where its runner packs, padded
    batches grouped by length (plan_batches, this device type's forward cost) otherwise. `packed_limit`: no packed
    forward reaches this many tokens (the packer's max_prompt_tokens: longer prompts run alone)."""
    if packed:
        limits = [n for n in (PACKED_FORWARD_TOKENS.get(device_type), packed_limit) if n]
        return plan_packed(items, length, max_num_batched_tokens, max_num_seqs, min(limits) if limits else None)
    return plan_batches(items, length, max_num_batched_tokens, max_num_seqs,
                        FORWARD_COST_TOKENS.get(device_type, DEFAULT_FORWARD_COST_TOKENS))


def plan_packed(items: Sequence[T], length: Callable[[T], int], max_num_batched_tokens: int,
                max_num_seqs: int, forward_tokens: int | None = None) -> list[Batch[T]]:
    """Batches of prompts packed end to end: at most `forward_tokens` (default and at most `max_num_batched_tokens`)
    tokens and `max_num_seqs` prompts each (best-fit decreasing); a prompt that long or longer alone (over the budget:
    chunked); a batch of one is not packed."""
    capacity = min(forward_tokens or max_num_batched_tokens, max_num_batched_tokens)
    members = sorted(items, key=length, reverse=True)
    alone: list[Batch[T]] = []
    bins: list[list[T]] = []
    room: list[tuple[int, int]] = []  # (tokens still free, bin) of the bins that take more, sorted
    for m in members:
        n = length(m)
        if n >= capacity:
            alone.append(Batch([m], n, min(n, max_num_batched_tokens)))
            continue
        i = bisect.bisect_left(room, (n, -1))  # the fullest bin with room for n
        if i < len(room):
            free, b = room.pop(i)
        else:
            free, b = capacity, len(bins)
            bins.append([])
        bins[b].append(m)
        if free - n > 0 and len(bins[b]) < max_num_seqs:
            bisect.insort(room, (free - n, b))
    packed = [Batch(b, length(b[0]), sum(length(m) for m in b), packed=len(b) > 1) for b in bins]
    return alone + packed


def first_batch_rows(lengths: Sequence[int], max_num_batched_tokens: int, max_num_seqs: int,
                     forward_cost_tokens: int = DEFAULT_FORWARD_COST_TOKENS) -> int:
    """Rows of the first batch of plan_batches' plan over `lengths` (sorted, longest first): how many of the longest
    waiting requests to prefill together now, so a long prompt does not pad a group of short ones to its length."""
    if not lengths:
        return 0
    i, j = _cuts(list(lengths), max_num_batched_tokens, max_num_seqs, forward_cost_tokens)[0]
    return j - i


def _cuts(lengths: list[int], budget: int, max_rows: int, forward_cost: int) -> list[tuple[int, int]]:
    """[(i, j)] cutting `lengths` (sorted, longest first) into batches of least padded tokens + forward costs."""
    n = len(lengths)
    if n == 0:
        return []
    ls = np.asarray(lengths, dtype=np.int64)
    # rows a batch starting at i may hold: its first row is its longest; a row over the budget goes alone
    cap = np.where(ls >= budget, 1, np.maximum(1, np.minimum(max_rows, budget // np.maximum(ls, 1))))
    best = np.full(n + 1, np.inf)  # best[j]: least cost of the first j rows
    best[0] = 0.0
    start = np.zeros(n + 1, dtype=np.int64)  # start[j]: first row of the last batch in that best plan
    for i in range(n):
        js = np.arange(i + 1, min(n, i + int(cap[i])) + 1)
        cost = best[i] + forward_cost + (js - i) * ls[i]  # batch [i, j) pads every row to ls[i]
        better = cost < best[js]
        best[js[better]] = cost[better]
        start[js[better]] = i
    cuts = []
    j = n
    while j > 0:
        i = int(start[j])
        cuts.append((i, j))
        j = i
    return cuts[::-1]
