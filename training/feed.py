"""The trainer's feed: where batches come from, and every item checked before it reaches one.

    TrainingStopped                  training cannot go on without bad data or bad weights (the message names the fix)
    CheckedFeed(ds, skip, spec)      a run's items, each readable, the manifest's file and finite; bad ones stop the
                                     training or (--skip-bad-samples) are left out and counted
    BatchSource                      what a source of batches must offer the training loop (a Protocol):
        feed                             its CheckedFeed (the run spec its samples follow: feed.spec; skipped samples)
        per_epoch                        batches per epoch; None: unknown until a pass ends (a live stream)
        epoch(epoch, done)               (packed batch or None, [(sample_id, reason), ...]) of `epoch` after `done`
        taken()                          the batch last given is trained on (or skipped for good)
        state() -> dict                  what a checkpoint keeps to resume the source where it is
    RunBatches(config, feed, replica)  a stored run's batches: ShardSampler's order, this replica's share, a DataLoader

training_jobs/live.py's LiveBatches (a live extraction) and training_jobs/fanout.py's FanoutBatches (one trainer's share of a fan-out
stream) are the other sources.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from training.collate import PackCollator
from training.train_config import TrainDrafterConfig

logger = logging.getLogger(__name__)


class TrainingStopped(ValueError):
    """Training cannot go on without training on bad data or saving bad weights; the message names the fix."""


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


class CheckedFeed:
    """The training dataset's items, each checked before it reaches a batch: readable, the file its manifest row
    commits (sample id and checksum, checked by the dataset), and finite. A bad item becomes {"bad": (sample_id,
    reason)} so that the training process (not a DataLoader worker) decides: stop with one line naming the sample,
    or, with `skip`, leave it out and count it."""

    def __init__(self, ds, skip: bool, spec=None) -> None:
        self.ds = ds
        """The run's HiddenStatesDataset; None for items that come from elsewhere (a live stream: `check`)."""
        self.spec = spec if spec is not None else ds.run_info
        self.skip = skip
        self.skipped: dict[str, str] = {}
        """sample id -> why it was left out (with `skip`; reasons seen by the token pass too)."""

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> dict[str, Any]:
        try:
            item = self.ds[index]
        except (OSError, ValueError) as e:
            return {"bad": (self.ds.sample_id(index), _one_line(e))}
        return self.check(item)

    def check(self, item: dict[str, Any]) -> dict[str, Any]:
        """`item`, or {"bad": (sample_id, reason)} when its states are not all finite."""
        states = item["hidden_states"]  # [T, L, H]
        finite = torch.isfinite(states)
        if not bool(finite.all()):
            t, layer, _ = (~finite).nonzero()[0].tolist()
            layer_id = self.spec.layer_ids[layer]
            return {"bad": (item["sample_id"], f"{int((~finite).sum())} NaN/Inf values in its hidden states (first "
                                               f"at token {t}, layer id {layer_id}), though its checksum is intact: "
                                               "the extraction produced them (an fp16 overflow?)")}
        return item

    def token_items(self):
        """The dataset's tokens-only pass (EAGLE-3's draft vocabulary), under the same policy for bad samples."""
        def bad(index: int, e: Exception) -> None:
            self.skipped.setdefault(self.ds.sample_id(index), _one_line(e))
            logger.warning("skipping sample %r: %s", self.ds.sample_id(index), _one_line(e))

        try:
            yield from self.ds.token_items(on_error=bad if self.skip else None)
        except (OSError, ValueError) as e:
            raise TrainingStopped(f"{_one_line(e)} (or pass --skip-bad-samples to train without such samples)"
                                  ) from e

    def collate(self, collate):
        """`collate` over the good items of a batch: (packed batch or None, [(sample_id, reason), ...])."""
        def call(items):
            good = [it for it in items if "bad" not in it]
            return (collate(good) if good else None), [it["bad"] for it in items if "bad" in it]

        return call

    def take_bad(self, bad: list[tuple[str, str]], step: int) -> None:
        """Stop on the batch's bad samples, or record them (`skip`)."""
        if not bad:
            return
        if not self.skip:
            sid, reason = bad[0]
            more = f" (and {len(bad) - 1} more in this batch)" if len(bad) > 1 else ""
            reason = reason.rstrip(".")
            fix = ("; or pass --skip-bad-samples to train without such samples" if "hsx verify" in reason else
                   ". Run `hsx verify RUN --all` (it marks bad samples) and re-run the same `hsx run` to re-extract "
                   "them, or pass --skip-bad-samples to train without them")
            raise TrainingStopped(f"training stopped before step {step + 1}: sample {sid!r}{more}: {reason}{fix}")
        for sid, reason in bad:
            if sid not in self.skipped:
                self.skipped[sid] = reason
                logger.warning("skipping sample %r: %s", sid, reason)


class BatchSource(Protocol):
    """What the training loop reads its batches from (see the module docstring, in call order)."""

    feed: CheckedFeed
    per_epoch: int | None

    def epoch(self, epoch: int, done: int) -> Iterable[tuple[dict[str, Any] | None, list[tuple[str, str]]]]:
        """(packed batch or None, bad samples) of `epoch` after its first `done` batches."""

    def taken(self) -> None:
        """The loop takes the batch last given."""

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (beyond (epoch, batches done)) to resume the source where it is."""


class RunBatches:
    """The batches of a stored run: each epoch the replica's share of every global batch in ShardSampler's order,
    read by a DataLoader (--num-workers processes). A position in it is (epoch, batches done in the epoch)."""

    def __init__(self, config: TrainDrafterConfig, feed: CheckedFeed, replica, collate=None) -> None:
        if collate is None:  # packed rows of at most --batch-tokens, the bad items apart
            collate = feed.collate(PackCollator(config.batch_tokens, pad_to_max=False, overlong="truncate"))
        self.config, self.feed, self.replica, self.collate = config, feed, replica, collate
        self.per_epoch = len(replica.batches(feed.ds.num_tokens, config.seed, 0, config.batch_tokens))
        """Optimizer steps in an epoch (None: unknown until the epoch ends, as for a live stream)."""

    def epoch(self, epoch: int, done: int):
        """(packed batch or None, bad samples) of `epoch` after its first `done` batches."""
        c = self.config
        batches = self.replica.batches(self.feed.ds.num_tokens, c.seed, epoch, c.batch_tokens)[done:]
        return DataLoader(self.feed, batch_sampler=batches, collate_fn=self.collate, num_workers=c.num_workers)

    def taken(self) -> None:
        """The loop takes the batch last given (a stored run's position is the loop's count of batches)."""

    def state(self) -> dict[str, Any]:
        """What a checkpoint must keep beyond (epoch, batches done) to resume here: nothing, for a run."""
        return {}
