"""Training curves in TensorBoard's event files: what `hsx train-drafter` logs per optimizer step.

    Curves(log_dir, resumed_step)    add(step, loss, result, lr, tokens, seconds) / flush() / close()

Tags (one scalar each per step): train/loss, train/lr, train/tokens_per_second, train/simulated_acceptance_length
and train/accuracy/pos_<i> (i = 1..k: the share of loss tokens whose i-th draft token is right). A training resumed
from its checkpoint at step S opens the writer with purge_step S + 1: TensorBoard's reader drops whatever the
interrupted process logged after S, so the resumed curve continues the first as one series (each step once).
"""

from __future__ import annotations

import os
import time


class Curves:
    def __init__(self, log_dir: str, resumed_step: int = 0) -> None:
        self.log_dir, self.resumed_step = log_dir, resumed_step
        self.writer = None
        self._held: list[tuple[str, float, int]] = []
        """Scalars before the first flush: nothing is written under OUT before the training's first checkpoint (a
        training refused or stopped before it leaves no OUT behind)."""

    def add(self, step: int, loss: float, result, lr: float, tokens: int, seconds: float) -> None:
        """One optimizer step: its loss, its StepResult (per-position counts over the global batch), the learning
        rate it used, its loss tokens and how long it took."""
        scalars = [("train/loss", loss), ("train/lr", lr),
                   ("train/simulated_acceptance_length", result.simulated_acceptance_length())]
        if seconds > 0:
            scalars.append(("train/tokens_per_second", tokens / seconds))
        scalars += [(f"train/accuracy/pos_{i}", a) for i, a in enumerate(result.accuracy(), start=1)]
        for tag, value in scalars:
            if self.writer is None:
                self._held.append((tag, float(value), step))
            else:
                self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        """Write what was logged (at each checkpoint: the steps a checkpoint holds are on disk before it)."""
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(self.log_dir, exist_ok=True)
            _after_existing_files(self.log_dir)
            self.writer = SummaryWriter(self.log_dir, purge_step=self.resumed_step + 1 if self.resumed_step else None,
                                        flush_secs=30)
            for tag, value, step in self._held:
                self.writer.add_scalar(tag, value, step)
            self._held.clear()
        self.writer.flush()

    def close(self) -> None:
        """Close the files; what was never flushed (no checkpoint was written) is dropped with the training."""
        if self.writer is not None:
            self.writer.close()


def _after_existing_files(log_dir: str) -> None:
    """Wait (at most a second) until this writer's file will sort after every event file already in `log_dir`:
    TensorBoard reads a folder's files in name order, and a name starts with the second it was opened in (then host
    and pid), so a process resumed within the same second as the one before it would otherwise be read first and
    its purge would miss the steps the earlier file logged."""
    names = [n.split(".") for n in os.listdir(log_dir) if n.startswith("events.out.tfevents.")]
    seconds = [int(parts[3]) for parts in names if len(parts) > 3 and parts[3].isdigit()]
    if seconds:
        wait = max(seconds) + 1 - time.time()
        if wait > 0:
            time.sleep(wait)
