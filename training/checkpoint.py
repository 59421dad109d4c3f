"""The training's checkpoints: what a resumed training continues from, written so that a kill never leaves half
of one.

    save_checkpoint(folder, state) / read_checkpoint(folder)   FOLDER/state.pt (local or s3://, gs://), atomic and
                                     durable; refused when the weights are not all finite
    load_checkpoint(folder, config, identity)   the checkpoint to resume, or None; refused when it belongs to
                                     another training (settings: config.resume_key()) or run (run_identity)
    run_identity(ds)                 what a resume must find unchanged in the run (run.json, the committed set)
    check_finite_weights(weights, what)   TrainingStopped naming the tensors that hold NaN/Inf
    rng_state() / set_rng_state(state)    the RNG states a checkpoint keeps (torch, Python, CUDA)
    SampleLog                        OUT/samples.jsonl (--log-sample-ids), cut back to the checkpoint on resume
    Checkpoints(config, check_lease, resumed).save(state, logged)   what replica 0 calls at each checkpoint
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import random
from typing import Any

import torch

from connectors import storage
from training.feed import TrainingStopped
from training.train_config import SAMPLE_LOG, STATE_NAME, TrainDrafterConfig, checkpoint_folder


def rng_state() -> dict[str, Any]:
    """The RNG states a checkpoint keeps: torch's, Python's and (when there is one) CUDA's."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back the RNG states of rng_state()."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(folder: str, state: dict[str, Any], storage_options: dict[str, Any] | None = None) -> None:
    """FOLDER/state.pt (a local folder or a URL: s3://, gs://), atomically and durably (a local disk: a unique
    temporary name, fsynced, renamed; an object store: one put that appears whole), so a kill mid-write leaves the
    previous checkpoint; refused when the model's weights are not all finite."""
    check_finite_weights(state["model"], f"the checkpoint of step {state['step']}")
    fs, root = storage.open_url(folder, storage_options)
    if storage.is_local(fs):
        os.makedirs(root, exist_ok=True)
    storage.put_atomic(fs, posixpath.join(root, STATE_NAME), lambda f: torch.save(state, f))
    storage.put_atomic(fs, posixpath.join(root, "step.json"), json.dumps({"step": state["step"]}).encode())


def read_checkpoint(folder: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The state saved in `folder` (local or a URL), or None when there is none; ValueError when it is damaged."""
    fs, root = storage.open_url(folder, storage_options)
    path = posixpath.join(root, STATE_NAME)
    if not fs.isfile(path):
        return None
    try:
        with fs.open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=False)
    except Exception as e:  # a damaged file: the user decides, nothing is overwritten
        raise ValueError(f"{storage.full_url(fs, path)} cannot be read ({e}); delete it to start over") from e


def check_finite_weights(weights: dict[str, torch.Tensor], what: str) -> None:
    """ValueError naming the tensors when a floating-point weight holds NaN/Inf: such a drafter is never saved."""
    counts = {name: int((~torch.isfinite(w)).sum()) for name, w in weights.items() if w.is_floating_point()}
    bad = {name: n for name, n in counts.items() if n}
    if bad:
        listed = ", ".join(f"{name} ({n})" for name, n in list(bad.items())[:4])
        raise TrainingStopped(f"{what} holds non-finite weights in {listed}{', ...' if len(bad) > 4 else ''}; it "
                              "was not saved (the last checkpoint, if any, is kept): the training diverged — lower "
                              "--lr or --max-grad-norm, or train in --dtype float32")


def run_identity(ds) -> dict[str, Any]:
    """What a resume must find unchanged in the run, whatever the spelling of --run: the sha256 of its run.json
    document and of its committed set (every "ok" row the dataset reads), and the committed count."""
    spec = json.dumps(ds.run_info.to_json(), sort_keys=True, default=str).encode()
    return {"run_sha256": hashlib.sha256(spec).hexdigest(), "committed_samples": len(ds),
            "committed_sha256": ds.committed_digest()}


def load_checkpoint(folder: str, config: TrainDrafterConfig, identity: dict[str, Any] | None = None
                    ) -> dict[str, Any] | None:
    """The checkpoint in `folder` to resume, or None; ValueError when it belongs to another training or run."""
    path = os.path.join(folder, STATE_NAME)
    state = read_checkpoint(folder, config.storage_options)
    if state is None:
        return None
    if not config.resume:
        raise ValueError(f"{path} exists (a training to resume); drop --no-resume to continue it, or pick another "
                         "--out")
    theirs, ours = state.get("resume_key", {}), config.resume_key()
    theirs = {"workers": 1, "online": False, **theirs}  # checkpoints from before --workers / --online
    diff = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
    if diff:
        listed = "; ".join(f"{k}: {a!r} in the checkpoint vs {b!r} now" for k, (a, b) in diff.items())
        raise ValueError(f"{path} belongs to another training ({listed}); use the same settings to resume, or pick "
                         "another --out")
    if identity is not None:
        _check_same_run(path, state.get("run_identity"), identity, config)
    return state


def _check_same_run(path: str, theirs: dict[str, Any] | None, ours: dict[str, Any],
                    config: TrainDrafterConfig) -> None:
    fix = ("a training resumes only on the data it started with: pick another --out to train on the run as it is "
           "now, or delete that checkpoint to start over")
    if not theirs:
        raise ValueError(f"{path} records no run identity (an older hsx wrote it), so hsx cannot tell that --run "
                         f"{config.run} is the run it started on; {fix}")
    if theirs.get("run_sha256") != ours["run_sha256"]:
        raise ValueError(f"{path} was trained on another run: the run.json of --run {config.run} differs from the "
                         f"one recorded when the training started; {fix}")
    if theirs.get("committed_sha256") != ours["committed_sha256"]:
        raise ValueError(f"{path} was trained on --run {config.run} as it was then: its manifest committed "
                         f"{theirs.get('committed_samples')} samples when the training started and commits "
                         f"{ours['committed_samples']} now (or the same number with other files: re-extracted, "
                         f"marked invalid, added); {fix}")


class SampleLog:
    """OUT/samples.jsonl (--log-sample-ids): one line per optimizer step, {"epoch", "step", "loss", "tokens", "time",
    "ids"} (the global batch's loss and loss tokens, when it ended, the samples it trained on, all replicas').
    Appended at each checkpoint before the state that records its length; a resumed training cuts it back to that
    length, so every line belongs to a step the checkpoint holds, once."""

    def __init__(self, out: str) -> None:
        self.path = os.path.join(out, SAMPLE_LOG)

    def resume(self, nbytes: int) -> None:
        if os.path.exists(self.path) and os.path.getsize(self.path) != nbytes:
            with open(self.path, "r+b") as f:
                f.truncate(nbytes)

    def append(self, lines: list[dict[str, Any]]) -> int:
        with open(self.path, "ab") as f:
            f.write(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
            return f.tell()


class Checkpoints:
    """Where replica 0 saves the training's state: OUT/checkpoint/ (save_checkpoint: atomic, durable) and, with
    --log-sample-ids, OUT/samples.jsonl; `check_lease` is called first (LeaseLost: another writer took --out)."""

    def __init__(self, config: TrainDrafterConfig, check_lease, resumed: dict[str, Any] | None) -> None:
        self.folder, self.storage_options = checkpoint_folder(config), config.storage_options
        self.check_lease = check_lease
        self.log = SampleLog(config.out) if config.log_sample_ids else None
        if self.log is not None:
            self.log.resume((resumed or {}).get("sample_log_bytes", 0))

    def save(self, state: dict[str, Any], logged: list[dict[str, Any]]) -> None:
        self.check_lease()
        if self.log is not None:
            state["sample_log_bytes"] = self.log.append(logged)
        save_checkpoint(self.folder, state, self.storage_options)
