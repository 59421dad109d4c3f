"""One drafter training session, whatever feeds it: the sequence every `hsx train-drafter` runs, once.

    Trainer(config, data, replicas=Here())   the checks, before any lease: --out, --checkpoint-dir and --log-dir
                                             (connectors.outputs), the data (data.check()), the drafter
                                             (new_drafter), the device
        .run() -> report                     under the folders' leases: the checkpoint to resume (load_checkpoint) ->
                                             drafter.prepare (a fresh training) -> the steps (replicas.train: the
                                             loop, checkpoints) -> the serving checkpoint and OUT/report.json (finish)
    TrainingData                             what a session trains on (a Protocol), in call order:
        check() -> Checked                       refuse what cannot train; the run spec, the target head, what a
                                                 resume must find unchanged, a live writer (--snapshot)
        vocabulary()                             what Drafter.prepare reads (EAGLE-3's draft vocabulary pass)
        batches(replica, resumed) -> BatchSource the loop's batches (training.feed); `resumed`: the checkpoint's
                                                 "source" part (what the batches' state() gave)
        report() -> (samples, extra)             what report.json says of the data
    StoredRun(config)                        a stored --run: the in-process and Ray Train sessions' data
                                             (training_jobs/live.py: LiveStream, a live extraction; training_jobs/fanout.py: a share)
    Replicas / Here                          where the steps run (a Protocol): Here in this process, with
                                             checkpoints in --out; training_jobs/train.py's RayTrain on N Ray Train replicas
    new_drafter(config, spec, target)        the --kind drafter, initialised from --seed (torch's and Python's RNGs)
    finish(...) -> report                    the trained drafter (serving layout) and OUT/report.json

Flow of a stored run: check the target folder and the run (not empty, from this target, holding the layers the
kind needs) -> `Drafter.for_run` -> `prepare(dataset)` (EAGLE-3: the draft vocabulary) -> steps over packed batches
-> the serving checkpoint in OUT (`save_pretrained`, e.g. the speculators layout) and OUT/report.json.

Batches: `ShardSampler` orders the samples (a new shuffle per epoch from `seed`), consecutive samples fill one packed
row of at most `batch_tokens` tokens (`PackCollator`; longer samples are truncated to it), a DataLoader reads them.
Every `checkpoint_every` steps OUT/checkpoint/ receives the model, optimizer, step, RNG states and the sampler's
position (epoch, batches done in it); a training started again with the same OUT continues from there and, with
the same settings, ends with the weights an uninterrupted training reaches. `steps`/`epochs` may change on resume
(train longer); the settings that shape the result may not (RESUME_FIELDS).

The report (and the progress bar): steps, trained tokens (loss-masked), final_loss, accuracy_per_position and
simulated_acceptance_length (StepResult's proxy: 1 + a0 + a0*a1 + ...) as means over the last 20 steps, wall time,
the run, the target and the settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Protocol

import fsspec
import torch

from connectors import storage
from drafters.base import TargetHead
from drafters.registry import drafter_class
from training.checkpoint import Checkpoints, check_finite_weights, load_checkpoint, run_identity
from training.checks import check_live_writer, check_run
from training.feed import BatchSource, CheckedFeed, RunBatches
from training.loop import Loop, Window, torch_device
from training.replicas import OneProcess
from training.train_config import REPORT_NAME, TrainDrafterConfig, checkpoint_folder


@dataclass(frozen=True)
class Checked:
    """What a session's data gives once its checks pass."""

    spec: Any
    """The run spec the samples follow (connectors.run.RunSpec: layer ids, target top-k, ...)."""
    target: TargetHead
    """The target's head (final norm, lm_head, embeddings) from --model."""
    identity: dict[str, Any]
    """What a resumed training must find unchanged in the data (checkpoint.run_identity for a run)."""
    snapshot: str | None = None
    """The live writer of the run when --snapshot trains on what it committed so far (report.json says so)."""


class TrainingData(Protocol):
    """What a training session trains on (see the module docstring, in call order)."""

    def check(self) -> Checked: ...

    def vocabulary(self) -> Any: ...

    def batches(self, replica, resumed: dict[str, Any] | None) -> BatchSource: ...

    def report(self) -> tuple[int, dict[str, Any]]: ...


class Replicas(Protocol):
    """Where a session's optimizer steps run."""

    def train(self, session: Trainer, state: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The steps from `state` (None: afresh) to the last: (the final state, what report.json adds)."""


class StoredRun:
    """A stored --run (`hsx run`'s output), read with every check (training.checks, training.feed.CheckedFeed)."""

    def __init__(self, config: TrainDrafterConfig) -> None:
        self.config = config
        self.ds = None
        self.feed: CheckedFeed | None = None
        """One feed for the vocabulary pass and the batches (samples skipped by either are reported)."""

    @classmethod
    def opened(cls, config: TrainDrafterConfig, ds) -> StoredRun:
        """The run already opened and checked elsewhere (a Ray Train replica, whose driver ran check()): its feed."""
        run = cls(config)
        run.ds, run.feed = ds, CheckedFeed(ds, skip=config.skip_bad_samples)
        return run

    def check(self) -> Checked:
        snapshot = check_live_writer(self.config)
        self.ds, target = check_run(self.config)
        self.feed = CheckedFeed(self.ds, skip=self.config.skip_bad_samples)
        return Checked(self.ds.run_info, target, run_identity(self.ds), snapshot)

    def vocabulary(self) -> CheckedFeed:
        return self.feed

    def batches(self, replica, resumed: dict[str, Any] | None) -> RunBatches:
        return RunBatches(self.config, self.feed, replica)

    def report(self) -> tuple[int, dict[str, Any]]:
        return len(self.ds), {}


class Here:
    """The steps in this process (training.replicas.OneProcess), checkpoints in --out (training.checkpoint)."""

    def train(self, session: Trainer, state: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
        config, replica = session.config, OneProcess()
        save = Checkpoints(config, session.out.check_lease, state).save
        resumed = state.get("source") if state is not None else None
        loop = Loop(config, session.data.batches(replica, resumed), session.drafter, session.target,
                    session.identity, session.device, session.dtype, replica, save, progress=config.progress)
        return loop.run(state), {}


def new_drafter(config: TrainDrafterConfig, spec, target: TargetHead):
    """The --kind drafter for states shaped as `spec`, initialised from --seed (torch's and Python's RNGs: the same
    drafter wherever a session makes it), not yet prepared; ValueError for an option its config does not have."""
    cls = drafter_class(config.kind)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    try:
        return cls.for_run(spec, target, config.drafts_per_step(cls), **config.drafter_options())
    except TypeError as e:  # an option the family's config does not have
        raise ValueError(f"--kind {config.kind}: bad family option ({e}); see the family's config for its fields"
                         ) from e


class Trainer:
    """One training session (see the module docstring): everything is checked when it is made (a fan-out makes all
    its sessions before its stream starts); run() trains once."""

    def __init__(self, config: TrainDrafterConfig, data: TrainingData, replicas: Replicas | None = None) -> None:
        self.started = time.monotonic()
        self.config, self.data, self.replicas = config, data, replicas if replicas is not None else Here()
        self.out = config.output_folder()
        self.out.check()
        checked = data.check()
        self.spec, self.target, self.identity, self.snapshot = (checked.spec, checked.target, checked.identity,
                                                                checked.snapshot)
        self.drafter = new_drafter(config, self.spec, self.target)
        self.device, self.dtype = torch_device(config.device), getattr(torch, config.dtype)

    def run(self) -> dict[str, Any]:
        """Train under the output folders' leases (a training refused or stopped before its first checkpoint leaves
        none of them behind); the report, also in OUT/report.json."""
        config = self.config
        with self.out.open():  # the checkpoint is read under the lease: another training cannot write it meanwhile
            state = load_checkpoint(checkpoint_folder(config), config, self.identity)
            if state is None:
                self.drafter.prepare(self.data.vocabulary())
            final, extra = self.replicas.train(self, state)
            samples, more = self.data.report()
            return finish(config, self.out, self.drafter, final, self.spec, samples, self.identity, self.started,
                          resumed_from=state["step"] if state is not None else None, snapshot=self.snapshot,
                          **more, **extra)


def finish(config: TrainDrafterConfig, out, drafter, final: dict[str, Any], spec, samples: int,
           identity: dict[str, Any], started: float, *, resumed_from: int | None, snapshot: str | None = None,
           **extra: Any) -> dict[str, Any]:
    """Save the trained drafter (`final`'s weights) in the serving layout and OUT/report.json; the report.
    `snapshot`: the live writer of the run when --snapshot trained on what it had committed (report "snapshot":
    true and "snapshot_writer")."""
    drafter.load_state_dict(final["model"])
    drafter.eval()
    verifier = os.path.abspath(config.model)
    check_finite_weights(drafter.state_dict(), "the trained drafter")
    out.check_lease()
    drafter.save_pretrained(config.out, verifier=verifier)
    window = Window()
    window.items.extend(final["window"])
    fig, skipped = window.figures(), final.get("skipped_samples", {})
    report = {
        "kind": config.kind, "run": config.run, "target": verifier, "out": os.path.abspath(config.out),
        "steps": final["step"], "epochs": round(final["step"] / final["batches_per_epoch"], 4)
        if final["batches_per_epoch"] else final["epoch"],
        "tokens": final["tokens"], "resumed_from_step": resumed_from, "final_loss": fig["loss"],
        "accuracy_per_position": fig["accuracy"], "simulated_acceptance_length": fig["simulated_acceptance_length"],
        "num_speculative_tokens": config.drafts_per_step(), "layer_ids": list(spec.layer_ids),
        "samples": samples, "skipped_samples": len(skipped), "skipped_batches": final.get("skipped_batches", 0),
        "skipped": dict(list(sorted(skipped.items()))[:100]), "run_identity": identity,
        "workers": config.session_key()["workers"],
        "memory_options": dataclasses.asdict(config.memory_options()),
        "snapshot": snapshot is not None, **({"snapshot_writer": snapshot} if snapshot is not None else {}),
        **extra, "wall_seconds": round(time.monotonic() - started, 3),
        "config": {k: v for k, v in dataclasses.asdict(config).items() if k != "storage_options"},
    }
    storage.put_atomic(fsspec.filesystem("file"), os.path.join(config.out, REPORT_NAME),
                       json.dumps(report, indent=2).encode())
    return report
