"""The replicas of a data-parallel training, as the trainer's loop sees them (torch.distributed; no Ray here: jobs/
starts the processes, e.g. with Ray Train's TorchTrainer).

    OneProcess()            a training in one process: today's `hsx train-drafter` (rank 0 of 1)
    TorchDistributed()      this process's place in an initialised torch.distributed group (gloo on CPU, NCCL on GPU)
    replica.batches(num_tokens, seed, epoch, batch_tokens)   this replica's batches of the epoch
    replica.gather(obj) / replica.sum(tensor) / replica.wrap(module)   the collectives the loop uses

Batches: one global batch = `world` replicas' batches. The global batches are the one-process batches of
world x batch_tokens tokens (samples truncated to batch_tokens, the per-replica size), in ShardSampler's order;
each global batch is split between the replicas by tokens (largest sample first to the least loaded replica), so
every replica has the same number of batches per epoch, the replicas' shares are disjoint and together hold every
sample of the epoch once, and a one-process training with --batch-tokens world x B sees the same global batches as
`world` replicas with --batch-tokens B (when no sample exceeds B).
"""

from __future__ import annotations

from typing import Any

import torch

from training.sampler import ShardSampler


def epoch_batches(num_tokens, seed: int, epoch: int, batch_tokens: int, sample_tokens: int | None = None
                  ) -> list[list[int]]:
    """The epoch's batches: ShardSampler's order (seed, epoch), consecutive samples while they fit batch_tokens
    (each counted at most `sample_tokens`, default batch_tokens: longer samples are truncated to it)."""
    cap = batch_tokens if sample_tokens is None else sample_tokens
    sampler = ShardSampler(len(num_tokens), num_replicas=1, rank=0, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    batches: list[list[int]] = []
    current, used = [], 0
    for i in sampler:
        n = min(int(num_tokens[i]), cap)
        if n == 0:
            continue
        if current and used + n > batch_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        batches.append(current)
    return batches


def split_batch(batch: list[int], num_tokens, world: int, cap: int) -> list[list[int]]:
    """`batch` split into `world` disjoint shares balanced by tokens (each sample counted at most `cap`); a share
    keeps the batch's order. Shares are empty only when the batch has fewer samples than replicas."""
    load = [0] * world
    owner: dict[int, int] = {}
    for i in sorted(batch, key=lambda i: -min(int(num_tokens[i]), cap)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += min(int(num_tokens[i]), cap)
    return [[i for i in batch if owner[i] == r] for r in range(world)]


class OneProcess:
    """The whole training in this process."""

    rank, world = 0, 1

    def batches(self, num_tokens, seed: int, epoch: int, batch_tokens: int) -> list[list[int]]:
        return epoch_batches(num_tokens, seed, epoch, batch_tokens)

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module


class TorchDistributed(OneProcess):
    """One replica of an initialised torch.distributed group: its share of each global batch, gradients averaged by
    DistributedDataParallel."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("TorchDistributed needs an initialised torch.distributed process group")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def batches(self, num_tokens, seed: int, epoch: int, batch_tokens: int) -> list[list[int]]:
        groups = epoch_batches(num_tokens, seed, epoch, batch_tokens * self.world, sample_tokens=batch_tokens)
        return [split_batch(g, num_tokens, self.world, batch_tokens)[self.rank] for g in groups]

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module)


class TrainingStep(torch.nn.Module):
    """A drafter's training step as a module's forward (what DistributedDataParallel wraps): (loss, correct,
    counted) of `drafter.training_step(batch, target)`; the target head is an argument, not a submodule (frozen,
    and never copied between replicas)."""

    def __init__(self, drafter: torch.nn.Module, device: torch.device | None = None) -> None:
        super().__init__()
        self.drafter = drafter
        self.device = device or torch.device("cpu")

    def forward(self, batch, target) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from drafters.memory import autocast

        with autocast(self.drafter.memory, self.device):  # --autocast (a no-op without it)
            result = self.drafter.training_step(batch, target)
        return result.loss, result.correct, result.counted
