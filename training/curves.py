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
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(log_dir, exist_ok=True)
        _after_existing_files(log_dir)
        self.writer = SummaryWriter(log_dir, purge_step=resumed_step + 1 if resumed_step else None, flush_secs=30)

    def add(self, step: int, loss: float, result, lr: float, tokens: int, seconds: float) -> None:
        """One optimizer step: its loss, its StepResult (per-position counts over the global batch), the learning
        rate it used, its loss tokens and how long it took."""
        w = self.writer
        w.add_scalar("train/loss", loss, step)
        w.add_scalar("train/lr", lr, step)
        if seconds > 0:
            w.add_scalar("train/tokens_per_second", tokens / seconds, step)
        w.add_scalar("train/simulated_acceptance_length", result.simulated_acceptance_length(), step)
        for i, accuracy in enumerate(result.accuracy(), start=1):
            w.add_scalar(f"train/accuracy/pos_{i}", accuracy, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
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
