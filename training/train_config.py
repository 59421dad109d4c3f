"""TrainDrafterConfig: the settings of one drafter training in this process, typed and validated (`hsx
train-drafter` maps onto it one to one: field `batch_tokens` is flag `--batch-tokens`; training_jobs.config.TrainJobConfig
extends it with the settings that train on Ray: --workers, --online, --fanout, ...).

    TrainDrafterConfig(...)            validated in __post_init__; errors name the flag to change
    config.resume_key()                the settings a resumed training must share with its checkpoint (RESUME_FIELDS)
    config.output_folder()             --out, --checkpoint-dir and --log-dir as connectors.outputs.OutputFolders
    config.drafts_per_step(cls)        k: --num-speculative-tokens or the family's default
    config.lr_at(step, total)          the learning-rate schedule (warmup, then constant or cosine)
    checkpoint_folder(config) / log_folder(config)   where checkpoints and TensorBoard curves go
    json_object(value, flag)           a JSON-object flag (--storage-options, --family-options, ...) as a dict

Hooks the jobs-side config overrides: reads_run() (whether --run is required), session_key() (replicas and feed,
as a resume and report.json see them), input_folders() (what the output folders must stay out of, e.g. --cache).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from connectors.outputs import OutputFolder, OutputFolders, output_folder_at
from drafters.registry import drafter_class, families

CHECKPOINT_DIR = "checkpoint"
STATE_NAME = "state.pt"
REPORT_NAME = "report.json"
TENSORBOARD_DIR = "tensorboard"
SAMPLE_LOG = "samples.jsonl"
LR_SCHEDULES = ("constant", "cosine")
RESUME_FIELDS = ("kind", "num_speculative_tokens", "lr", "lr_schedule", "weight_decay", "warmup_steps",
                 "max_grad_norm", "batch_tokens", "seed", "dtype", "draft_vocab_size", "ttt_steps", "family_options",
                 "skip_bad_samples")
"""Settings a resumed training must share with the checkpoint's (besides the run's and the model's identity; then
session_key()'s "workers" and "online")."""
LEGACY_MARKERS = (f"{CHECKPOINT_DIR}/{STATE_NAME}", REPORT_NAME)
"""Files that mark an --out as a training's output from before hsx wrote ownership markers."""


def json_object(value: Any, name: str) -> dict[str, Any]:
    """A JSON-object setting (field `name`, given as a JSON string or a mapping) as a dict; ValueError naming the
    flag otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"--{name.replace('_', '-')} is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"--{name.replace('_', '-')} must be a JSON object, got {type(value).__name__}")
    return dict(value)


@dataclass(frozen=True)
class TrainDrafterConfig:
    """A drafter training (`hsx train-drafter`: field `batch_tokens` = flag `--batch-tokens`)."""

    run: str = ""
    """The extraction run to train on: a local folder or URL (s3://, gs://) holding run.json, data/ and manifest/
    (--online trains from --corpus instead)."""
    model: str = ""
    """The target model's local folder (the model the run was extracted from): its final norm, lm_head, embeddings."""
    out: str = ""
    """Local folder for the trained drafter (serving layout), OUT/report.json and OUT/checkpoint/."""
    kind: str = "eagle3"
    """Drafter family: any in the registry (drafters/registry.py)."""
    steps: int | None = None
    """Optimizer steps to train (one packed batch each); default: --epochs."""
    epochs: float | None = None
    """Passes over the run (fractions allowed); used when --steps is not given (default 1)."""
    num_speculative_tokens: int | None = None
    """k, the tokens drafted per step when decoding (Medusa heads, MLPSpeculator stages; EAGLE-3's default k); default
    the family's: 3, DFlash's block_size - 1."""
    lr: float = 1e-4
    """AdamW learning rate (constant after warmup)."""
    lr_schedule: str = "constant"
    """After warmup: "constant", or "cosine" (down to lr/10 at the last step; a resume must keep --steps/--epochs)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warmup over this many steps."""
    max_grad_norm: float = 0.5
    """Clip the gradient norm to this (0 = no clipping)."""
    batch_tokens: int = 4096
    """Tokens per packed batch (samples are truncated to it); with --workers N, per replica."""
    seed: int = 0
    """Seed of the initialisation and the shuffle."""
    device: str = "auto"
    """torch device: auto (cuda when available), cpu, cuda, cuda:1, ..."""
    dtype: str = "float32"
    """Dtype of the drafter's weights and the computation: float32, bfloat16, float16."""
    gradient_checkpointing: bool = False
    """Recompute the draft layers' MLPs (DFlash: its layers; Medusa: its residual blocks; MLPSpeculator: its stage
    norms) in the backward instead of keeping their activations: less memory, more compute, the same result."""
    ce_chunk_tokens: int = 0
    """Cross-entropy over the vocabulary this many rows at a time, the logits recomputed in the backward (0: all at
    once): the [tokens, vocabulary] logits are never kept whole; the same result."""
    autocast: str | None = None
    """Run each training step under torch.autocast in this dtype (bfloat16; meant for GPUs), the weights and the
    optimizer in --dtype."""
    draft_vocab_size: int | None = None
    """EAGLE-3 only: tokens of the draft vocabulary (default 32000, capped at the target's vocabulary)."""
    ttt_steps: int | None = None
    """EAGLE-3 only: test-time-training unroll steps (default 3)."""
    family_options: dict[str, Any] = field(default_factory=dict)
    """Further options of the family's config, as JSON (e.g. '{"num_layers": 2}' for EAGLE-3)."""
    checkpoint_every: int = 200
    """Write a checkpoint every this many steps (and at the end)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go: a local folder or a URL (s3://, gs://; --storage-options apply); default OUT/checkpoint.
    A training started again with the same --out and --checkpoint-dir continues from it. Checked like --out before
    any step (not the model, the run, inside either, a file, or another command's folder) and leased with it."""
    resume: bool = True
    """Continue from OUT/checkpoint when it exists (--no-resume: refuse to overwrite it)."""
    num_workers: int = 0
    """DataLoader worker processes (0 = read in the training process)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for a remote --run, as JSON (endpoint_url, credentials, ...)."""
    progress: bool = True
    """Show a progress bar (loss, per-position accuracy, simulated acceptance length) on stderr."""
    skip_bad_samples: bool = False
    """Skip (and count, in report.json) samples whose file is missing, damaged, not the manifest row's, or holds
    NaN/Inf states, and batches whose loss or gradient is not finite, instead of stopping at the first one."""
    break_lease: bool = False
    """Take --out over from another training that looks alive (only when that one is known to be gone)."""
    log_sample_ids: bool = False
    """Write OUT/samples.jsonl: per optimizer step its epoch, step and the ids of the samples trained on (a resumed
    training's log holds each checkpointed step once)."""
    log_dir: str | None = None
    """Where the TensorBoard curves go (loss, accuracy per position, simulated acceptance length, learning rate,
    tokens/s per step; `tensorboard --logdir DIR`); default OUT/tensorboard. A resumed training continues them.
    A local folder, checked and leased like --checkpoint-dir."""
    image_inputs: str = "vision"
    """A multimodal run: what the drafter reads at image tokens: vision (the target's merged input embeddings, stored
    by `hsx run --mm-embeds`: what vLLM's proposer feeds it there) or placeholder (the image token's own embedding,
    as peers train). The loss is off at image tokens either way."""
    snapshot: bool = False
    """Train on a run that an `hsx run` is writing now: on the samples it has committed so far (report.json says so
    and names the writer). Without it, such a run is refused."""

    def __post_init__(self) -> None:
        if self.image_inputs not in ("vision", "placeholder"):
            raise ValueError(f"--image-inputs must be vision or placeholder, got {self.image_inputs!r}")
        for name in ("storage_options", "family_options"):
            object.__setattr__(self, name, json_object(getattr(self, name), name))
        for name in ("model", "out") + (("run",) if self.reads_run() else ()):
            if not str(getattr(self, name) or "").strip():
                raise ValueError(f"--{name} is required (or key {name!r} in the --config file)")
        found = families().get(self.kind)
        if found is None:
            raise ValueError(f"--kind {self.kind!r} is not a drafter family; choose one of {sorted(families())}")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give --steps or --epochs, not both")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"--epochs must be > 0, got {self.epochs}")
        for name in ("num_speculative_tokens", "batch_tokens", "checkpoint_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.num_workers < 0 or self.max_grad_norm < 0 or self.weight_decay < 0:
            raise ValueError("--warmup-steps, --num-workers, --max-grad-norm and --weight-decay must be >= 0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"--lr-schedule {self.lr_schedule!r}: use one of {list(LR_SCHEDULES)}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype {self.dtype!r}: use float32, bfloat16 or float16")
        self.memory_options()  # checked
        takes = getattr(found, "options", ())
        for name in ("draft_vocab_size", "ttt_steps"):
            if name not in takes and getattr(self, name) is not None:
                owners = sorted(n for n, f in families().items() if name in getattr(f, "options", ()))
                raise ValueError(f"--{name.replace('_', '-')} applies to --kind {' / '.join(owners)} only")

    def memory_options(self):
        """--gradient-checkpointing, --ce-chunk-tokens and --autocast as the drafter's MemoryOptions."""
        from drafters.memory import MemoryOptions

        return MemoryOptions(self.gradient_checkpointing, self.ce_chunk_tokens, self.autocast)

    def reads_run(self) -> bool:
        """Whether the samples come from --run (required then); jobs' --online reads a corpus instead."""
        return True

    def session_key(self) -> dict[str, Any]:
        """How the session runs, as a resume compares it and report.json says it: its replicas ("workers") and
        whether a live extraction feeds it ("online"); here one process on a stored run."""
        return {"workers": 1, "online": False}

    def input_folders(self) -> dict[str, str]:
        """The inputs (flag -> path) the output folders must not be, nor sit inside: --model and --run."""
        return {k: v for k, v in (("--model", self.model), ("--run", self.run)) if v}

    def drafts_per_step(self, cls: type | None = None) -> int:
        """k: --num-speculative-tokens, else the family's default (Drafter.default_num_speculative_tokens)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        if cls is None:
            cls = drafter_class(self.kind)
        return int(cls.default_num_speculative_tokens(self.drafter_options()))

    def drafter_options(self) -> dict[str, Any]:
        """Keyword options for the family's for_run (its config's fields)."""
        options = dict(self.family_options)
        if self.draft_vocab_size is not None:
            options["draft_vocab_size"] = self.draft_vocab_size
        if self.ttt_steps is not None:
            options["ttt_steps"] = self.ttt_steps
        return options

    def resume_key(self) -> dict[str, Any]:
        """The settings a resume must share (the run's identity is compared apart: see run_identity)."""
        length = ("steps", "epochs") if self.lr_schedule != "constant" else ()
        return {**{name: getattr(self, name) for name in RESUME_FIELDS}, **self.session_key(),
                **{name: getattr(self, name) for name in length}, "model": os.path.realpath(self.model)}

    def output_folder(self) -> OutputFolders:
        """--out, --checkpoint-dir and --log-dir as one connectors.outputs.OutputFolders: none of them the model, the
        run, the --cache, inside one of them or a file, each empty or this training's own; one writer each. The
        defaults (OUT/checkpoint, OUT/tensorboard) are part of --out, unless a symlink takes them elsewhere."""
        inputs = self.input_folders()
        main = OutputFolder(self.out, command="train-drafter", flag="--out", inputs=inputs,
                            legacy_markers=LEGACY_MARKERS, break_lease=self.break_lease)
        more = [output_folder_at(path, command=f"train-drafter {flag}", flag=flag, inputs={**inputs, "--out": self.out},
                                 storage_options=self.storage_options, legacy_markers=legacy,
                                 break_lease=self.break_lease)
                for flag, path, legacy in (("--checkpoint-dir", checkpoint_folder(self), (STATE_NAME,)),
                                           ("--log-dir", log_folder(self), ("events.out.tfevents.*",)))]
        if not isinstance(more[1], OutputFolder):
            raise ValueError(f"--log-dir {self.log_dir}: a local folder is expected (TensorBoard writes there; copy "
                             "it to the store afterwards)")
        return OutputFolders(main, *more)

    def lr_at(self, step: int, total: int) -> float:
        """The learning rate of optimizer step `step` (0-based) of `total`."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "cosine":
            span = max(1, total - self.warmup_steps - 1)
            done = min(1.0, (step - self.warmup_steps) / span)
            return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))
        return self.lr


def checkpoint_folder(config: TrainDrafterConfig) -> str:
    """Where the training's checkpoints go: --checkpoint-dir, or OUT/checkpoint."""
    return config.checkpoint_dir or os.path.join(config.out, CHECKPOINT_DIR)


def log_folder(config: TrainDrafterConfig) -> str:
    """Where the training's TensorBoard curves go: --log-dir, or OUT/tensorboard."""
    return config.log_dir or os.path.join(config.out, TENSORBOARD_DIR)

