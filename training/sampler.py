"""Distributed sampling over a dataset: every rank a disjoint share, all ranks together every sample exactly once.

    ShardSampler(dataset_or_size, num_replicas, rank, shuffle=True, seed=0)   a torch Sampler of indices
    sampler.set_epoch(epoch)                                                  a new shared order each epoch
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, Sampler


class ShardSampler(Sampler[int]):
    """Indices for one rank: a disjoint share of the dataset; the shares of all ranks cover it exactly once.

    Unlike torch's DistributedSampler, nothing is repeated to even out the shares: ranks differ by at most one
    sample. With `shuffle`, every rank draws the same permutation (from seed + epoch) and takes every
    num_replicas-th index of it; call `set_epoch` each epoch for a new order.
    """

    def __init__(self, dataset_or_size: Dataset | int, num_replicas: int | None = None, rank: int | None = None,
                 *, shuffle: bool = True, seed: int = 0) -> None:
        self.size = dataset_or_size if isinstance(dataset_or_size, int) else len(dataset_or_size)
        if num_replicas is None or rank is None:
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                raise ValueError("ShardSampler needs num_replicas and rank (or an initialised torch.distributed)")
            num_replicas = torch.distributed.get_world_size() if num_replicas is None else num_replicas
            rank = torch.distributed.get_rank() if rank is None else rank
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1} (num_replicas={num_replicas})")
        self.num_replicas, self.rank, self.shuffle, self.seed = num_replicas, rank, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=g)
        else:
            order = torch.arange(self.size)
        return iter(order[self.rank::self.num_replicas].tolist())

    def __len__(self) -> int:
        return max(0, math.ceil((self.size - self.rank) / self.num_replicas))
