"""The optimizer steps of one replica: the training loop, a step and its hooks.

    Loop(config, source, drafter, target, identity, device, dtype, replica, save, progress=)
        .run(state) -> final state        from `state` (a checkpoint; None: the drafter as prepared) to the last step;
                                          every replica runs it in lockstep, replica 0 calls save(state, logged steps)
                                          at each checkpoint and at the end
        .exchange(packed, bad)            hook: this replica's batch, and what every replica learns of the others'
        .step(batch, weight, ...)         one step: forward, backward, the finite guard, the optimizer's step
        .checkpoint() -> state            the state a resumed training continues from (saved by replica 0)
    StepLog                               hook: where a step is recorded (window, TensorBoard curves, the sample-id
                                          log, the progress bar)
    Window                                loss and per-position counts over the last 20 steps (progress bar, report)
    torch_device(name)                    --device as a torch.device

Per step every replica learns (one gather) what the others hold: bad samples (the same stop or skip everywhere),
states that overflow --dtype, how many loss tokens. Each replica's loss is weighted by its share of the global
batch's loss tokens (so the averaged gradient is the global batch's, as in one process); a replica without samples
in a global batch (fewer samples than replicas) steps on its last batch with weight 0.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from drafters.base import DrafterBatch, StepResult
from training.checkpoint import rng_state, set_rng_state
from training.curves import Curves
from training.feed import BatchSource, TrainingStopped
from training.replicas import TrainingStep
from training.train_config import TrainDrafterConfig, log_folder

logger = logging.getLogger(__name__)


def torch_device(name: str) -> torch.device:
    """--device as a torch.device: auto is cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a torch device ({e})") from e


class Window:
    """Loss and per-position counts over the last `size` steps (the progress bar's and the report's figures)."""

    def __init__(self, size: int = 20) -> None:
        self.items: deque = deque(maxlen=size)

    def add(self, loss: float, correct: torch.Tensor, counted: torch.Tensor) -> None:
        self.items.append((loss, correct.tolist(), counted.tolist()))

    def figures(self) -> dict[str, Any]:
        if not self.items:
            return {"loss": None, "accuracy": [], "simulated_acceptance_length": None}
        correct = torch.tensor([c for _, c, _ in self.items]).sum(0)
        counted = torch.tensor([n for _, _, n in self.items]).sum(0)
        result = StepResult(torch.tensor(0.0), correct, counted)
        return {"loss": sum(v for v, _, _ in self.items) / len(self.items), "accuracy": result.accuracy(),
                "simulated_acceptance_length": result.simulated_acceptance_length()}


@dataclass
class Position:
    """Where the training is: optimizer steps taken, the epoch and the batches done in it, loss tokens trained on,
    batches skipped."""

    step: int = 0
    epoch: int = 0
    done_in_epoch: int = 0
    tokens: int = 0
    skipped_batches: int = 0


class StepLog:
    """Where each step is recorded: the window of the last steps (progress bar, report), the TensorBoard curves
    (replica 0), the lines of OUT/samples.jsonl (--log-sample-ids; written with each checkpoint) and the progress
    bar."""

    def __init__(self, config: TrainDrafterConfig, rank: int, progress: bool) -> None:
        self.config, self.rank, self.progress = config, rank, progress
        self.window = Window()
        self.logged: list[dict[str, Any]] = []
        """The sample-id log's lines since the last checkpoint."""
        self.curves: Curves | None = None
        self.bar = None
        self.step_started = 0.0

    def open(self, step: int, total: int | None) -> None:
        """Start recording at optimizer step `step` (a resumed training's) of `total`."""
        if self.rank == 0:
            self.curves = Curves(log_folder(self.config), resumed_step=step)
        self.step_started = time.monotonic()
        if self.progress:
            self.bar = tqdm(total=total, initial=step, desc=f"train {self.config.kind}", unit="step",
                            dynamic_ncols=True)

    def record(self, at: Position, loss: float, result: StepResult, lr: float, tokens: int, ids: list[str]) -> None:
        """Optimizer step `at.step` is done: its global batch's loss, counts, learning rate, loss tokens, samples."""
        self.window.add(loss, result.correct, result.counted)
        if self.curves is not None:
            now = time.monotonic()
            self.curves.add(at.step, loss, result, lr, tokens, now - self.step_started)
            self.step_started = now
        if self.config.log_sample_ids:
            self.logged.append({"epoch": at.epoch, "step": at.step, "loss": loss, "tokens": tokens,
                                "time": time.time(), "ids": ids})
        if self.bar is not None:
            fig = self.window.figures()
            self.bar.set_postfix_str(f"loss {fig['loss']:.3f} acc "
                                     f"{'/'.join(f'{a:.2f}' for a in fig['accuracy'])} "
                                     f"AL {fig['simulated_acceptance_length']:.2f}")
            self.bar.update(1)

    def flush(self) -> None:
        """Before a checkpoint: the steps it holds are in the event files."""
        if self.curves is not None:
            self.curves.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.curves is not None:
            self.curves.close()


class Loop:
    """The optimizer steps of one replica (`replica`: training.replicas.OneProcess or TorchDistributed) over
    `source`'s batches (see the module docstring)."""

    def __init__(self, config: TrainDrafterConfig, source: BatchSource, drafter, target, identity: dict[str, Any],
                 device: torch.device, dtype: torch.dtype, replica, save, *, progress: bool = False) -> None:
        self.config, self.source, self.drafter, self.identity = config, source, drafter, identity
        self.feed, self.spec = source.feed, source.feed.spec
        self.device, self.dtype, self.replica, self.save = device, dtype, replica, save
        drafter.to(device, dtype)
        drafter.use_memory(config.memory_options())
        self.target = target.to(device, dtype)
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=(0.9, 0.95),
                                           weight_decay=config.weight_decay)
        self.model = replica.wrap(TrainingStep(drafter, device))
        self.log = StepLog(config, replica.rank, progress)
        self.at = Position()
        self.last_batch: DrafterBatch | None = None
        """The last batch this replica stepped on (a replica without samples in a global batch steps on it)."""

    def run(self, state: dict[str, Any] | None) -> dict[str, Any]:
        """Train from `state` to the last step; the final state (also saved by replica 0)."""
        self._restore(state)
        per_epoch, epochs = self.source.per_epoch, self.config.epochs or 1.0
        total = self.config.steps if self.config.steps is not None else (
            max(1, math.ceil(epochs * per_epoch)) if per_epoch is not None else None)  # None: until the passes end
        self.log.open(self.at.step, total)
        self.drafter.train()
        try:
            while total is None or self.at.step < total:
                if self._epoch(total, epochs):
                    break
            return self.checkpoint()
        finally:
            self.log.close()

    def _restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        at = self.at
        self.drafter.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        at.step, at.epoch, at.done_in_epoch, at.tokens = (state["step"], state["epoch"], state["batch_in_epoch"],
                                                          state["tokens"])
        self.feed.skipped.update(state.get("skipped_samples", {}))
        at.skipped_batches = state.get("skipped_batches", 0)
        self.log.window.items.extend(state["window"])
        set_rng_state(state["rng"])
        if self.replica.rank == 0:
            logger.info("resuming %s from step %d (epoch %d, batch %d)", self.config.out, at.step, at.epoch,
                        at.done_in_epoch)

    def _epoch(self, total: int | None, epochs: float) -> bool:
        """The source's epoch from where the training is; True when the training ends within it or with it."""
        at = self.at
        steps_before, whole_epoch = at.step, at.done_in_epoch == 0
        for packed, bad in self.source.epoch(at.epoch, at.done_in_epoch):
            if total is not None and at.step >= total:
                return True
            at.done_in_epoch += 1
            self.source.taken()
            self._take(packed, bad, total)
        if whole_epoch and at.step == steps_before:
            raise TrainingStopped(f"--run {self.config.run}: a whole epoch gave no training step: every batch "
                                  f"was skipped ({len(self.feed.skipped)} bad samples); run `hsx verify "
                                  f"{self.config.run} --all` and re-run the extraction")
        at.epoch, at.done_in_epoch = at.epoch + 1, 0
        return total is None and at.epoch >= epochs

    def _take(self, packed: dict[str, Any] | None, bad: list[tuple[str, str]], total: int | None) -> None:
        """One global batch: what the replicas hold of it, then a step on it or a skip."""
        config, at = self.config, self.at
        batch, mine, seen = self.exchange(packed, bad)
        self.feed.take_bad([b for s in seen for b in s["bad"]], at.step)
        if not any(s["ids"] for s in seen):
            return
        if not all(s["finite"] for s in seen):
            if not config.skip_bad_samples:
                overflowing = [i for s in seen if not s["finite"] for i in s["ids"]]
                raise TrainingStopped(f"training stopped at step {at.step + 1}: the states of samples "
                                      f"{overflowing[:4]} overflow --dtype {config.dtype}; train in "
                                      "bfloat16 or float32")
            at.skipped_batches += 1
            return
        if not all(s["ready"] for s in seen):  # a replica without samples and no batch to step on yet
            at.skipped_batches += 1
            return
        world = self.replica.world
        global_tokens = sum(s["tokens"] for s in seen)
        weight = 1.0 if world == 1 else (world * mine / global_tokens if global_tokens else 1.0)
        if batch is None:
            batch, weight = self.last_batch, 0.0
        every = [i for s in seen for i in s["ids"]]
        stepped = self.step(batch, weight, mine, global_tokens, every, total)
        if stepped is None:
            at.skipped_batches += 1
            return
        at.step += 1
        at.tokens += global_tokens
        self.last_batch = batch if weight else self.last_batch
        self.log.record(at, *stepped, self.optimizer.param_groups[0]["lr"], global_tokens, every)
        if at.step % config.checkpoint_every == 0:
            self.checkpoint()

    def exchange(self, packed: dict[str, Any] | None, bad: list[tuple[str, str]]):
        """(this replica's batch on the device or None, its loss tokens, what every replica holds): one gather of
        each replica's bad samples, sample ids, whether its states are finite as stored (not in --dtype), loss
        tokens, and whether it has a batch to step on."""
        batch, ids, finite, mine = None, [], True, 0
        if packed is not None:
            ids = list(packed["sample_id"])
            batch = DrafterBatch.from_packed(packed, self.spec.layer_ids).to(self.device, self.dtype)
            finite = bool(torch.isfinite(batch.hidden_states).all()) and (
                batch.target_topk is None or bool(torch.isfinite(batch.target_topk[1]).all()))
            mine = int(batch.loss_mask.sum())
        seen = self.replica.gather({"bad": bad, "ids": ids, "finite": finite, "tokens": mine,
                                    "ready": batch is not None or self.last_batch is not None})
        return batch, mine, seen

    def step(self, batch: DrafterBatch, weight: float, mine: int, global_tokens: int, ids: list[str],
             total: int | None) -> tuple[float, StepResult] | None:
        """One optimizer step on `batch`, its loss weighted by `weight`: (the global batch's loss, its counts), or
        None when the loss or the gradient norm is not finite (nothing applied; TrainingStopped unless
        --skip-bad-samples)."""
        config, world = self.config, self.replica.world
        for group in self.optimizer.param_groups:
            group["lr"] = config.lr_at(self.at.step, total)
        self.optimizer.zero_grad(set_to_none=True)
        result = StepResult(*self.model(batch, self.target))
        loss = float(result.loss.detach())
        if world > 1:
            loss, result = self._global(loss, result, weight, mine, global_tokens)
        if not math.isfinite(loss):
            if world > 1:  # every replica's backward runs (DDP's gradient exchange), nothing is applied
                (result.loss * 0.0).backward()
                self.optimizer.zero_grad(set_to_none=True)
            self._not_finite(f"the loss is {loss}", ids)
            return None
        (result.loss * weight if weight != 1.0 else result.loss).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, config.max_grad_norm or math.inf))
        if not math.isfinite(norm):
            self._not_finite(f"the gradient norm is {norm}", ids)
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.optimizer.step()
        return loss, result

    def _global(self, loss: float, result: StepResult, weight: float, mine: int, global_tokens: int
                ) -> tuple[float, StepResult]:
        """The global batch's loss (weighted by loss tokens) and counts, NaN unless every replica's is finite (one
        sum over the replicas)."""
        device = self.device if self.device.type == "cuda" else "cpu"
        summed = self.replica.sum(torch.tensor(
            [float(not math.isfinite(loss)), loss * mine if weight else 0.0,
             *(result.correct.float().cpu() * (weight > 0)), *(result.counted.float().cpu() * (weight > 0))],
            dtype=torch.float64, device=device)).cpu()
        k = len(result.correct)
        loss = math.nan if summed[0] else float(summed[1]) / max(1, global_tokens)
        return loss, StepResult(result.loss, summed[2:2 + k].round().long(), summed[2 + k:].round().long())

    def _not_finite(self, what: str, ids: list[str]) -> None:
        shown = ", ".join(repr(i) for i in ids[:4]) + (", ..." if len(ids) > 4 else "")
        step = self.at.step
        if self.config.skip_bad_samples:
            logger.warning("skipping the batch of step %d (samples %s): %s", step + 1, shown, what)
            return
        raise TrainingStopped(f"training stopped at step {step + 1}: {what} on the batch of samples {shown}; nothing "
                              "of this step was applied or saved. Their stored states are finite, so the training "
                              "diverged: lower --lr or --max-grad-norm, or train in --dtype float32 (or pass "
                              "--skip-bad-samples to skip such batches)")

    def checkpoint(self) -> dict[str, Any]:
        """The training's state now; replica 0 saves it (with the sample-id log's lines since the last one)."""
        at = self.at
        current = {
            "step": at.step, "epoch": at.epoch, "batch_in_epoch": at.done_in_epoch, "tokens": at.tokens,
            "model": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(), "rng": rng_state(),
            "window": list(self.log.window.items), "resume_key": self.config.resume_key(),
            "run_identity": self.identity, "skipped_samples": dict(self.feed.skipped),
            "skipped_batches": at.skipped_batches, "batches_per_epoch": self.source.per_epoch,
            "source": self.source.state()}
        if self.replica.rank == 0:
            self.log.flush()
            self.save(current, self.log.logged)
        self.log.logged.clear()
        return current
