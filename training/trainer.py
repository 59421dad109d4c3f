"""Training a drafter on an hsx run: `hsx train-drafter` and its Python API.

    TrainDrafterConfig            what to train (kind, run, target, out) and how (steps/epochs, lr, batch tokens, ...)
    train_drafter(config) -> dict the report (also written to OUT/report.json)
    check_run(config) -> (dataset, target)   the checks done before any training (usable on their own)
    --kind                        a drafter family of the registry (drafters/registry.py): eagle3, medusa,
                                  mlp_speculator, or any registered one

Flow: check the target folder and the run (not empty, from this target, holding the layers the kind needs) ->
`Drafter.for_run` -> `prepare(dataset)` (EAGLE-3: the draft vocabulary) -> steps over packed batches -> the serving
checkpoint in OUT (`save_pretrained`, e.g. the speculators layout) and OUT/report.json.

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
import logging
import math
import os
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"
STATE_NAME = "state.pt"
REPORT_NAME = "report.json"
TENSORBOARD_DIR = "tensorboard"
SAMPLE_LOG = "samples.jsonl"
LR_SCHEDULES = ("constant", "cosine")
RESUME_FIELDS = ("kind", "num_speculative_tokens", "lr", "lr_schedule", "weight_decay", "warmup_steps",
                 "max_grad_norm", "batch_tokens", "seed", "dtype", "draft_vocab_size", "ttt_steps", "family_options",
                 "skip_bad_samples", "workers", "online")
"""Settings a resumed training must share with the checkpoint's (besides the run's and the model's identity)."""
LEGACY_MARKERS = (f"{CHECKPOINT_DIR}/{STATE_NAME}", REPORT_NAME)
"""Files that mark an --out as a training's output from before hsx wrote ownership markers."""


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
    """Drafter family: eagle3, medusa, mlp_speculator, or any other in the registry (drafters/registry.py)."""
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
    workers: int = 1
    """Data-parallel replicas on Ray Train (DDP: gloo on CPU, NCCL on GPU), each reading its share of every global
    batch: the global batch is --workers x --batch-tokens. 1 (the default): this process alone."""
    gpus_per_worker: float | None = None
    """GPUs each replica takes with --workers N (default: 1 when the Ray cluster has GPUs, else 0: CPU and gloo)."""
    address: str | None = None
    """An existing Ray cluster to train on (ray://host:10001, host:6379, auto); default: $RAY_ADDRESS, else a private
    local Ray. Implies training on Ray (with --workers replicas)."""
    max_failures: int = 3
    """With --workers N: times the replicas are restarted from the last checkpoint after one dies (0 = none)."""
    online: bool = False
    """Train from a live extraction instead of a stored run: --corpus goes through `hsx run`'s readers,
    tokenization and extraction workers on Ray, and each sample's states reach the trainer through Ray's object store
    (nothing written; --run not used). Each epoch is one pass over the corpus (the target runs again)."""
    corpus: tuple[str, ...] = ()
    """--online: the corpus files (JSONL or Parquet, globs, any fsspec URL), as `hsx run --corpus`."""
    extract: dict[str, Any] = field(default_factory=dict)
    """--online: further `hsx run` settings for the extraction, as JSON with its config keys (e.g. '{"layers":
    "1,2,4", "max_tokens": 64, "include_output_tokens": true, "workers": 2}')."""
    fanout: str | None = None
    """--online: train several drafters from one stream (the target runs once per sample and pass for all): a YAML
    or JSON file listing each trainer's settings over this command's (each its own out; e.g. kind, lr, seed, steps,
    family_options). Reported per trainer."""
    cache: str | None = None
    """--online: also store the first pass as an ordinary `hsx run` in this folder or URL (manifest, checksums,
    exactly once, resumable; --storage-options apply); later epochs read it instead of running the target again."""
    shuffle_mb: float = 256.0
    """--online: the stream's samples are mixed in a buffer of this many MiB of states (seeded by --seed and the
    epoch) before they fill batches; 0 keeps the workers' order."""
    inflight_mb: float = 512.0
    """--online: Ray object-store memory the stream may hold ahead of the trainer (states extracted, not yet
    trained on); the extraction waits when it is full."""
    log_sample_ids: bool = False
    """Write OUT/samples.jsonl: per optimizer step its epoch, step and the ids of the samples trained on (a resumed
    training's log holds each checkpointed step once)."""
    log_dir: str | None = None
    """Where the TensorBoard curves go (loss, accuracy per position, simulated acceptance length, learning rate,
    tokens/s per step; `tensorboard --logdir DIR`); default OUT/tensorboard. A resumed training continues them.
    A local folder, checked and leased like --checkpoint-dir."""
    snapshot: bool = False
    """Train on a run that an `hsx run` is writing now: on the samples it has committed so far (report.json says so
    and names the writer). Without it, such a run is refused."""

    def __post_init__(self) -> None:
        if isinstance(self.corpus, str):
            object.__setattr__(self, "corpus", (self.corpus,))
        object.__setattr__(self, "corpus", tuple(str(c) for c in self.corpus))
        for name in ("storage_options", "family_options", "extract"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = json.loads(value) if value.strip() else {}
                except json.JSONDecodeError as e:
                    raise ValueError(f"--{name.replace('_', '-')} is not valid JSON ({e})") from e
            if not isinstance(value, dict):
                raise ValueError(f"--{name.replace('_', '-')} must be a JSON object, got {type(value).__name__}")
            object.__setattr__(self, name, dict(value))
        for name in ("model", "out") + (() if self.online else ("run",)):
            if not str(getattr(self, name) or "").strip():
                raise ValueError(f"--{name} is required (or key {name!r} in the --config file)")
        if self.online:
            if self.run or not self.corpus:
                raise ValueError("--online trains from --corpus through a live extraction: give --corpus FILES and "
                                 "no --run")
            if self.workers > 1:
                raise ValueError("--online trains in one process (--workers 1) for now; train on a stored run "
                                 "(`hsx run`, then --run) for --workers N")
            if self.lr_schedule != "constant" and self.steps is None:
                raise ValueError("--online with --lr-schedule cosine needs --steps (a live corpus has no known "
                                 "length)")
            if self.epochs is not None and self.epochs != int(self.epochs):
                raise ValueError(f"--online trains whole passes over the corpus: --epochs {self.epochs} must be "
                                 "a whole number")
            if not self.inflight_mb > 0 or self.shuffle_mb < 0:
                raise ValueError(f"--inflight-mb must be > 0 and --shuffle-mb >= 0, got {self.inflight_mb} and "
                                 f"{self.shuffle_mb}")
            if self.snapshot:
                raise ValueError("--snapshot reads a stored --run that an `hsx run` is writing; --online has none: "
                                 "drop --snapshot")
        elif self.corpus or self.extract or self.cache or self.fanout:
            raise ValueError("--corpus, --extract, --cache and --fanout belong to --online training; without "
                             "--online, train on --run")
        from drafters.registry import families

        found = families().get(self.kind)
        if found is None:
            raise ValueError(f"--kind {self.kind!r} is not a drafter family; choose one of {sorted(families())}")
        if self.workers < 1 or self.max_failures < 0:
            raise ValueError(f"--workers must be >= 1 and --max-failures >= 0, got {self.workers} and "
                             f"{self.max_failures}")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ValueError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")
        if self.distributed() and self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device {self.device!r} with --workers {self.workers}: Ray gives each replica its "
                             "device; use --gpus-per-worker (and --device auto, cpu or cuda)")
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
        takes = getattr(found, "options", ())
        for name in ("draft_vocab_size", "ttt_steps"):
            if name not in takes and getattr(self, name) is not None:
                owners = sorted(n for n, f in families().items() if name in getattr(f, "options", ()))
                raise ValueError(f"--{name.replace('_', '-')} applies to --kind {' / '.join(owners)} only")

    def distributed(self) -> bool:
        """Whether this training runs on Ray (jobs.train): --workers > 1 or an --address."""
        return self.workers > 1 or bool(self.address)

    def drafts_per_step(self, cls: type | None = None) -> int:
        """k: --num-speculative-tokens, else the family's default (Drafter.default_num_speculative_tokens)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        if cls is None:
            from drafters.registry import drafter_class

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
        names = RESUME_FIELDS + (("steps", "epochs") if self.lr_schedule != "constant" else ())
        return {**{name: getattr(self, name) for name in names}, "model": os.path.realpath(self.model)}

    def output_folder(self):
        """--out, --checkpoint-dir and --log-dir as one connectors.outputs.OutputFolders: none of them the model, the
        run, the --cache, inside one of them or a file, each empty or this training's own; one writer each. The
        defaults (OUT/checkpoint, OUT/tensorboard) are part of --out, unless a symlink takes them elsewhere."""
        from connectors.outputs import OutputFolder, OutputFolders, output_folder_at

        inputs = {k: v for k, v in (("--model", self.model), ("--run", self.run), ("--cache", self.cache)) if v}
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


# -- checks before training -------------------------------------------------------------------------------------


def target_config(model: str):
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"--model {model!r} is not a local model folder (no config.json); pass the folder of the "
                         "target model the run was extracted from")
    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {model!r}: cannot read its config ({e})") from e


def _same_model(run_spec, model_dir: str, hf) -> list[str]:
    """Why the run was not extracted from the model at `model_dir` ([] = it was, as far as the records tell): the
    run's recorded shape and architecture against the engine's facts of the target (extractor.facts.target_facts),
    then the recorded model folder's config.json, when it is still there."""
    from connectors.run import RunSpec
    from extractor.facts import target_facts

    target = RunSpec.from_file_spec(target_facts(hf, model=model_dir).file_spec())
    said = {"num_hidden_layers": "the run's model has {0} layers, the target {1}",
            "hidden_size": "the run's states are {0} wide, the target's {1}",
            "architecture": "the run's model is a {0}, the target a {1}"}
    problems = [said[name].format(ours, theirs) for name, (ours, theirs) in run_spec.differences(target, list(said)).items()
                if name != "architecture" or (ours and theirs)]
    recorded = run_spec.model
    if recorded and os.path.isfile(os.path.join(recorded, "config.json")) and \
            os.path.realpath(recorded) != os.path.realpath(model_dir):
        with open(os.path.join(recorded, "config.json")) as a, open(os.path.join(model_dir, "config.json")) as b:
            if json.load(a) != json.load(b):
                problems.append(f"the run was extracted from {recorded}, whose config.json differs from the target's")
    return problems


def _warn_if_other_weights(run_spec, model_dir: str, hf) -> None:
    """Warn when the run's recorded model fingerprint (connectors.fingerprint: config,
    tokenizer, weight files' headers, sizes and times) differs from the target folder's. Not a refusal: a copy of the
    same model differs too (its files' times), but so does another fine-tune of the same base, which the config
    checks above cannot tell apart and whose states would train a drafter for the wrong model."""
    from connectors.fingerprint import FINGERPRINT_SCHEME, model_fingerprint

    recorded = run_spec.model_fingerprint or ""
    if not recorded.startswith(FINGERPRINT_SCHEME):
        return  # no fingerprint, or the first round's scheme: nothing to compare with
    here = model_fingerprint(model_dir, hf)
    if here == recorded:
        return
    logger.warning("the run %s records model fingerprint %s, the target %s has %s: its weights, config or tokenizer "
                   "files are not the ones the run was extracted from (or they were copied since). If it is another "
                   "model (a different fine-tune of the same base), the drafter will learn the wrong states: train "
                   "against the model the run was extracted from", run_spec.model, recorded, model_dir, here)


def _committed_samples(config: TrainDrafterConfig) -> int | None:
    """Samples the run's manifest commits (None: no manifest to count, the dataset says what is wrong)."""
    from connectors.manifest import REQUIRED_COLUMNS, committed_rows, read_manifest
    from connectors.run import MANIFEST_DIR, RunDir

    try:
        run = RunDir(config.run, config.storage_options)
        if not run.exists(MANIFEST_DIR):
            return None
        return committed_rows(read_manifest(run, columns=list(REQUIRED_COLUMNS))).num_rows
    except (OSError, ValueError):
        return None


def open_dataset(config: TrainDrafterConfig, run: str | None = None):
    """The run (default --run) as the trainer reads it (raw layout, samples truncated to --batch-tokens, with their
    ids)."""
    from training.dataset import HiddenStatesDataset

    run = run or config.run
    try:
        return HiddenStatesDataset(run, layout="raw", storage_options=config.storage_options,
                                   max_length=config.batch_tokens, include_sample_id=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{run}: cannot open the run ({e})") from e


def check_layers(config: TrainDrafterConfig, spec, what: str, layers_fix: str) -> None:
    """ValueError when the states `spec` describes cannot train --kind: another layer convention, a post-norm last
    layer, a top-k target for a kind that reads layer N, layers missing (`layers_fix` names the fix, {ids} the
    layers to ask for)."""
    from drafters.registry import drafter_class

    cls = drafter_class(config.kind)
    if spec.layer_id_convention != "vllm":
        raise ValueError(f"{what} counts layers in the {spec.layer_id_convention!r} convention; drafters "
                         "read hsx runs in vLLM's ids — re-extract with hsx")
    n = int(spec.num_hidden_layers)
    if spec.last_layer_normalized and n in spec.layer_ids:
        raise ValueError(f"{what} stored layer {n} after the final norm; drafters apply the target's "
                         "final norm themselves and need it pre-norm (hsx's default) — re-extract without normalising")
    need = cls.required_layer_ids(n, None)
    if spec.target_top_k is not None:
        if not cls.reads_topk_target:
            raise ValueError(f"--kind {config.kind} trains on the state of layer {n} itself, but {what} "
                             f"keeps a {spec.target} target in its place (the target's top-{spec.target_top_k} "
                             "next-token log-probabilities, which only EAGLE-3-style training reads); re-extract "
                             f"with --target states and layer {n} in --layers for {config.kind}")
        need = tuple(i for i in need if i != n)  # the top-k target stands in for N
    missing = [i for i in need if i not in spec.layer_ids]
    if missing:
        ids = ",".join(str(i) for i in sorted({*spec.layer_ids, *need}))
        raise ValueError(f"--kind {config.kind} needs layers {list(need)} but {what} stores {list(spec.layer_ids)} "
                         f"(missing {missing}); " + layers_fix.format(ids=ids))


def check_run(config: TrainDrafterConfig):
    """(dataset, target head) once the target folder, the run and the kind's needs are checked; ValueError naming
    the fix otherwise."""
    from drafters.base import TargetHead

    hf = target_config(config.model)
    if _committed_samples(config) == 0:
        raise ValueError(f"--run {config.run} has no extracted samples (its manifest holds no 'ok' rows); run the "
                         "extraction first (`hsx run`), or see why its samples failed with `hsx status`")
    ds = open_dataset(config)
    spec = ds.run_info
    if len(ds) == 0 or int(ds.num_tokens.sum()) == 0:
        raise ValueError(f"--run {config.run} has no extracted samples (its manifest holds no 'ok' rows); run the "
                         "extraction first (`hsx run`), or check it with `hsx status`")
    problems = _same_model(spec, config.model, hf)
    if problems:
        raise ValueError(f"--run {config.run} is not from the target --model {config.model}: {'; '.join(problems)}. "
                         "Train against the model the run was extracted from (or re-extract with this one)")
    _warn_if_other_weights(spec, config.model, hf)
    check_layers(config, spec, f"--run {config.run}", "re-extract with --layers {ids}")
    target = TargetHead.from_model_dir(config.model)
    first = next(CheckedFeed(ds, skip=config.skip_bad_samples).token_items(), None)
    if first is None:
        raise ValueError(f"--run {config.run}: none of its {len(ds)} samples can be read (see the warnings); run "
                         f"`hsx verify {config.run} --all`, then re-run the extraction")
    first = first["input_ids"]
    if first.numel() and int(first.max()) >= target.vocab_size:
        raise ValueError(f"--run {config.run} holds token id {int(first.max())}, outside the target's vocabulary of "
                         f"{target.vocab_size}: the run is from another tokenizer or model")
    return ds, target


# -- batches ------------------------------------------------------------------------------------------------------


def torch_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a torch device ({e})") from e


# -- checkpoints --------------------------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_folder(config: TrainDrafterConfig) -> str:
    """Where the training's checkpoints go: --checkpoint-dir, or OUT/checkpoint."""
    return config.checkpoint_dir or os.path.join(config.out, CHECKPOINT_DIR)


def log_folder(config: TrainDrafterConfig) -> str:
    """Where the training's TensorBoard curves go: --log-dir, or OUT/tensorboard."""
    return config.log_dir or os.path.join(config.out, TENSORBOARD_DIR)


def save_checkpoint(folder: str, state: dict[str, Any], storage_options: dict[str, Any] | None = None) -> None:
    """FOLDER/state.pt (a local folder or a URL: s3://, gs://), atomically and durably (a local disk: a unique
    temporary name, fsynced, renamed; an object store: one put that appears whole), so a kill mid-write leaves the
    previous checkpoint; refused when the model's weights are not all finite."""
    import posixpath

    import torch

    from connectors import storage

    check_finite_weights(state["model"], f"the checkpoint of step {state['step']}")
    fs, root = storage.open_url(folder, storage_options)
    if storage.is_local(fs):
        os.makedirs(root, exist_ok=True)
    storage.put_atomic(fs, posixpath.join(root, STATE_NAME), lambda f: torch.save(state, f))
    storage.put_atomic(fs, posixpath.join(root, "step.json"), json.dumps({"step": state["step"]}).encode())


def read_checkpoint(folder: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The state saved in `folder` (local or a URL), or None when there is none; ValueError when it is damaged."""
    import posixpath

    import torch

    from connectors import storage

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
    import torch

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
    import hashlib

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


# -- the feed: every item checked ------------------------------------------------------------------------------


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
        import torch

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


# -- the loop -----------------------------------------------------------------------------------------------------


class _Window:
    """Loss and per-position counts over the last `size` steps (the progress bar's and the report's figures)."""

    def __init__(self, size: int = 20) -> None:
        self.items: deque = deque(maxlen=size)

    def add(self, loss: float, correct: torch.Tensor, counted: torch.Tensor) -> None:
        self.items.append((loss, correct.tolist(), counted.tolist()))

    def figures(self) -> dict[str, Any]:
        import torch

        from drafters.base import StepResult

        if not self.items:
            return {"loss": None, "accuracy": [], "simulated_acceptance_length": None}
        correct = torch.tensor([c for _, c, _ in self.items]).sum(0)
        counted = torch.tensor([n for _, _, n in self.items]).sum(0)
        result = StepResult(torch.tensor(0.0), correct, counted)
        return {"loss": sum(v for v, _, _ in self.items) / len(self.items), "accuracy": result.accuracy(),
                "simulated_acceptance_length": result.simulated_acceptance_length()}


def train_drafter(config: TrainDrafterConfig) -> dict[str, Any]:
    """Train `config.kind` on `config.run` in this process; the report (see the module docstring), also in
    OUT/report.json. `--workers N` (data-parallel replicas on Ray Train) is jobs.train.train_drafter's.

    Before any work: --out, --checkpoint-dir and --log-dir are checked (connectors.outputs: never the model, the
    run, inside either, a file, or another folder holding one; writable), then whether an `hsx run` writes the run
    now (refused unless --snapshot), then the run. Then the folders are taken (one writer each); a training refused
    or stopped before its first checkpoint leaves none of them behind."""
    import torch

    if config.distributed():
        raise ValueError(f"--workers {config.workers} / --address train on Ray: call jobs.train.train_drafter (what "
                         "`hsx train-drafter` does), not training.trainer.train_drafter")
    from training.replicas import OneProcess

    started = time.monotonic()
    out, ds, target, identity, drafter, snapshot = prepare_training(config)
    device, dtype = torch_device(config.device), getattr(torch, config.dtype)
    with out.open():  # the checkpoint is read under the lease: another training cannot write it meanwhile
        state = load_checkpoint(checkpoint_folder(config), config, identity)
        feed = CheckedFeed(ds, skip=config.skip_bad_samples)
        if state is None:
            drafter.prepare(feed)
        checkpoints = Checkpoints(config, out.check_lease, state)
        final = train_loop(config, feed, target, drafter, state, identity, device, dtype, OneProcess(),
                           checkpoints.save, progress=config.progress)
        return finish(config, out, drafter, final, ds, identity, started,
                      resumed_from=state["step"] if state is not None else None, snapshot=snapshot)


def prepare_training(config: TrainDrafterConfig):
    """(output folders, dataset, target head, run identity, untrained drafter, snapshot) once --out, --checkpoint-dir,
    --log-dir and the run are checked; the drafter is initialised from `config.seed` (not yet `prepare`d on the
    data). `snapshot`: the live writer of the run, described, when --snapshot trains on what it committed so far."""
    import torch

    out = config.output_folder()
    out.check()
    snapshot = check_live_writer(config)
    ds, target = check_run(config)
    identity = run_identity(ds)
    from drafters.registry import drafter_class

    cls = drafter_class(config.kind)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    try:
        drafter = cls.for_run(ds.run_info, target, config.drafts_per_step(cls), **config.drafter_options())
    except TypeError as e:  # an option the family's config does not have
        raise ValueError(f"--kind {config.kind}: bad family option ({e}); see the family's config for its fields"
                         ) from e
    return out, ds, target, identity, drafter, snapshot


def check_live_writer(config: TrainDrafterConfig) -> str | None:
    """The live writer of --run, described, when --snapshot lets the training read what it committed so far; None
    when no writer is live. ValueError naming the writer and --snapshot when one is and --snapshot was not given."""
    from connectors.lease import snapshot_writer
    from connectors.run import RunDir

    if config.online:
        return None  # no stored run: the training's own extraction
    try:
        run = RunDir(config.run, config.storage_options)
    except (OSError, ValueError):
        return None  # an unreadable run: check_run says what is wrong with it
    try:
        return snapshot_writer(run, snapshot=config.snapshot, what=f"--run {config.run}",
                               harm="a training would read only the samples committed so far and could not resume "
                                    "once more are", doing="train on what it has committed now")
    except OSError:
        return None  # storage that does not answer: check_run says so


class SampleLog:
    """OUT/samples.jsonl (--log-sample-ids): one line per optimizer step, {"epoch", "step", "loss", "tokens", "time",
    "ids"} (the global batch's loss and loss tokens, when it ended, the samples it trained on, all replicas'). Appended at each checkpoint before the state that records its length; a resumed
    training cuts it back to that length, so every line belongs to a step the checkpoint holds, once."""

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


# -- the loop -----------------------------------------------------------------------------------------------------


class RunBatches:
    """The batches of a stored run: each epoch the replica's share of every global batch in ShardSampler's order,
    read by a DataLoader (--num-workers processes). A position in it is (epoch, batches done in the epoch)."""

    def __init__(self, config: TrainDrafterConfig, feed: CheckedFeed, replica, collate) -> None:
        self.config, self.feed, self.replica, self.collate = config, feed, replica, collate
        self.per_epoch = len(replica.batches(feed.ds.num_tokens, config.seed, 0, config.batch_tokens))
        """Optimizer steps in an epoch (None: unknown until the epoch ends, as for a live stream)."""

    def epoch(self, epoch: int, done: int):
        """(packed batch or None, bad samples) of `epoch` after its first `done` batches."""
        from torch.utils.data import DataLoader

        c = self.config
        batches = self.replica.batches(self.feed.ds.num_tokens, c.seed, epoch, c.batch_tokens)[done:]
        return DataLoader(self.feed, batch_sampler=batches, collate_fn=self.collate, num_workers=c.num_workers)

    def taken(self) -> None:
        """The loop takes the batch last given (a stored run's position is the loop's count of batches)."""

    def state(self) -> dict[str, Any]:
        """What a checkpoint must keep beyond (epoch, batches done) to resume here: nothing, for a run."""
        return {}


def train_loop(config: TrainDrafterConfig, feed: CheckedFeed, target, drafter, state: dict[str, Any] | None,
               identity: dict[str, Any], device, dtype, replica, save, *, progress: bool = False, source=None,
               spec=None) -> dict[str, Any]:
    """The optimizer steps of one replica (`replica`: training.replicas.OneProcess or TorchDistributed) from
    `state` (a checkpoint; None: the `drafter` as initialised and prepared) to the last step; every replica runs it
    in lockstep and replica 0 calls save(state, logged steps) at each checkpoint and at the end. The final state.

    Per step every replica learns (one gather) what the others hold: bad samples (the same stop or skip everywhere),
    states that overflow --dtype, how many loss tokens. Each replica's loss is weighted by its share of the global
    batch's loss tokens (so the averaged gradient is the global batch's, as in one process); a replica without
    samples in a global batch (fewer samples than replicas) steps on its last batch with weight 0.

    `source` gives the batches (default: RunBatches over `feed`'s run; a live stream for --online, whose `spec` is
    the run spec its samples follow); a checkpoint keeps source.state() and passes it back to a resumed source."""
    import torch

    from drafters.base import DrafterBatch, StepResult
    from training.collate import PackCollator
    from training.replicas import TrainingStep

    world = replica.world
    spec = spec if spec is not None else feed.ds.run_info
    if source is None:
        collate = feed.collate(PackCollator(config.batch_tokens, pad_to_max=False, overlong="truncate"))
        source = RunBatches(config, feed, replica, collate)
    drafter.to(device, dtype)
    target = target.to(device, dtype)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    model = replica.wrap(TrainingStep(drafter))
    window = _Window()
    step, epoch, done_in_epoch, tokens, skipped_batches = 0, 0, 0, 0, 0
    if state is not None:
        drafter.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, epoch, done_in_epoch, tokens = state["step"], state["epoch"], state["batch_in_epoch"], state["tokens"]
        feed.skipped.update(state.get("skipped_samples", {}))
        skipped_batches = state.get("skipped_batches", 0)
        window.items.extend(state["window"])
        _set_rng_state(state["rng"])
        if replica.rank == 0:
            logger.info("resuming %s from step %d (epoch %d, batch %d)", config.out, step, epoch, done_in_epoch)
    per_epoch, epochs = source.per_epoch, config.epochs or 1.0
    total = config.steps if config.steps is not None else (
        max(1, math.ceil(epochs * per_epoch)) if per_epoch is not None else None)  # None: until the passes end
    logged: list[dict[str, Any]] = []
    last_batch = None

    def checkpoint() -> dict[str, Any]:
        current = {
            "step": step, "epoch": epoch, "batch_in_epoch": done_in_epoch, "tokens": tokens,
            "model": drafter.state_dict(), "optimizer": optimizer.state_dict(), "rng": _rng_state(),
            "window": list(window.items), "resume_key": config.resume_key(), "run_identity": identity,
            "skipped_samples": dict(feed.skipped), "skipped_batches": skipped_batches,
            "batches_per_epoch": per_epoch, "source": source.state()}
        if replica.rank == 0:
            if curves is not None:  # the steps a checkpoint holds are in the event files before it
                curves.flush()
            save(current, logged)
        logged.clear()
        return current

    def not_finite(what: str, ids: list[str]) -> None:
        shown = ", ".join(repr(i) for i in ids[:4]) + (", ..." if len(ids) > 4 else "")
        if config.skip_bad_samples:
            logger.warning("skipping the batch of step %d (samples %s): %s", step + 1, shown, what)
            return
        raise TrainingStopped(f"training stopped at step {step + 1}: {what} on the batch of samples {shown}; nothing "
                              "of this step was applied or saved. Their stored states are finite, so the training "
                              "diverged: lower --lr or --max-grad-norm, or train in --dtype float32 (or pass "
                              "--skip-bad-samples to skip such batches)")

    curves = None
    if replica.rank == 0:
        from training.curves import Curves

        curves = Curves(log_folder(config), resumed_step=step)
    step_started = time.monotonic()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=step, desc=f"train {config.kind}", unit="step", dynamic_ncols=True)
    drafter.train()
    try:
        while total is None or step < total:
            steps_before, whole_epoch = step, done_in_epoch == 0
            for packed, bad in source.epoch(epoch, done_in_epoch):
                if total is not None and step >= total:
                    break
                done_in_epoch += 1
                source.taken()
                batch, ids, finite, mine = None, [], True, 0
                if packed is not None:
                    ids = list(packed["sample_id"])
                    batch = DrafterBatch.from_packed(packed, spec.layer_ids).to(device, dtype)
                    finite = bool(torch.isfinite(batch.hidden_states).all()) and (  # finite as stored, not in --dtype
                        batch.target_topk is None or bool(torch.isfinite(batch.target_topk[1]).all()))
                    mine = int(batch.loss_mask.sum())
                seen = replica.gather({"bad": bad, "ids": ids, "finite": finite, "tokens": mine,
                                       "ready": batch is not None or last_batch is not None})
                feed.take_bad([b for s in seen for b in s["bad"]], step)
                if not any(s["ids"] for s in seen):
                    continue
                if not all(s["finite"] for s in seen):
                    if not config.skip_bad_samples:
                        overflowing = [i for s in seen if not s["finite"] for i in s["ids"]]
                        raise TrainingStopped(f"training stopped at step {step + 1}: the states of samples "
                                              f"{overflowing[:4]} overflow --dtype {config.dtype}; train in "
                                              "bfloat16 or float32")
                    skipped_batches += 1
                    continue
                if not all(s["ready"] for s in seen):  # a replica without samples and no batch to step on yet
                    skipped_batches += 1
                    continue
                global_tokens = sum(s["tokens"] for s in seen)
                weight = 1.0 if world == 1 else (world * mine / global_tokens if global_tokens else 1.0)
                if batch is None:
                    batch, weight = last_batch, 0.0
                for group in optimizer.param_groups:
                    group["lr"] = config.lr_at(step, total)
                optimizer.zero_grad(set_to_none=True)
                result = StepResult(*model(batch, target))
                loss = float(result.loss.detach())
                if world > 1:  # the global batch's loss (weighted by loss tokens) and counts, and whether all finite
                    summed = replica.sum(torch.tensor(
                        [float(not math.isfinite(loss)), loss * mine if weight else 0.0,
                         *(result.correct.float().cpu() * (weight > 0)), *(result.counted.float().cpu() * (weight > 0))],
                        dtype=torch.float64, device=device if device.type == "cuda" else "cpu")).cpu()
                    k = len(result.correct)
                    loss = math.nan if summed[0] else float(summed[1]) / max(1, global_tokens)
                    result = StepResult(result.loss, summed[2:2 + k].round().long(), summed[2 + k:].round().long())
                every = [i for s in seen for i in s["ids"]]
                if not math.isfinite(loss):
                    if world > 1:  # every replica's backward runs (DDP's gradient exchange), nothing is applied
                        (result.loss * 0.0).backward()
                        optimizer.zero_grad(set_to_none=True)
                    not_finite(f"the loss is {loss}", every)
                    skipped_batches += 1
                    continue
                (result.loss * weight if weight != 1.0 else result.loss).backward()
                norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm or math.inf))
                if not math.isfinite(norm):
                    not_finite(f"the gradient norm is {norm}", every)
                    optimizer.zero_grad(set_to_none=True)
                    skipped_batches += 1
                    continue
                optimizer.step()
                step += 1
                tokens += global_tokens
                last_batch = batch if weight else last_batch
                window.add(loss, result.correct, result.counted)
                if curves is not None:
                    now = time.monotonic()
                    curves.add(step, loss, result, optimizer.param_groups[0]["lr"], global_tokens, now - step_started)
                    step_started = now
                if config.log_sample_ids:
                    logged.append({"epoch": epoch, "step": step, "loss": loss, "tokens": global_tokens,
                                   "time": time.time(), "ids": every})
                if bar is not None:
                    fig = window.figures()
                    bar.set_postfix_str(f"loss {fig['loss']:.3f} acc "
                                        f"{'/'.join(f'{a:.2f}' for a in fig['accuracy'])} "
                                        f"AL {fig['simulated_acceptance_length']:.2f}")
                    bar.update(1)
                if step % config.checkpoint_every == 0:
                    checkpoint()
            else:
                if whole_epoch and step == steps_before:
                    raise TrainingStopped(f"--run {config.run}: a whole epoch gave no training step: every batch "
                                          f"was skipped ({len(feed.skipped)} bad samples); run `hsx verify "
                                          f"{config.run} --all` and re-run the extraction")
                epoch, done_in_epoch = epoch + 1, 0
                if total is None and epoch >= epochs:
                    break
        final = checkpoint()
    finally:
        if bar is not None:
            bar.close()
        if curves is not None:
            curves.close()
    return final


def finish(config: TrainDrafterConfig, out, drafter, final: dict[str, Any], ds, identity: dict[str, Any],
           started: float, *, resumed_from: int | None, snapshot: str | None = None, **extra: Any) -> dict[str, Any]:
    """Save the trained drafter (`final`'s weights) in the serving layout and OUT/report.json; the report.
    `snapshot`: the live writer of the run when --snapshot trained on what it had committed (report "snapshot":
    true and "snapshot_writer")."""
    import fsspec

    from connectors import storage

    drafter.load_state_dict(final["model"])
    drafter.eval()
    verifier = os.path.abspath(config.model)
    check_finite_weights(drafter.state_dict(), "the trained drafter")
    out.check_lease()
    drafter.save_pretrained(config.out, verifier=verifier)
    window = _Window()
    window.items.extend(final["window"])
    fig, skipped = window.figures(), final.get("skipped_samples", {})
    report = {
        "kind": config.kind, "run": config.run, "target": verifier, "out": os.path.abspath(config.out),
        "steps": final["step"], "epochs": round(final["step"] / final["batches_per_epoch"], 4)
        if final["batches_per_epoch"] else final["epoch"],
        "tokens": final["tokens"], "resumed_from_step": resumed_from, "final_loss": fig["loss"],
        "accuracy_per_position": fig["accuracy"], "simulated_acceptance_length": fig["simulated_acceptance_length"],
        "num_speculative_tokens": config.drafts_per_step(), "layer_ids": list(ds.run_info.layer_ids),
        "samples": len(ds), "skipped_samples": len(skipped), "skipped_batches": final.get("skipped_batches", 0),
        "skipped": dict(list(sorted(skipped.items()))[:100]), "run_identity": identity, "workers": config.workers,
        "snapshot": snapshot is not None, **({"snapshot_writer": snapshot} if snapshot is not None else {}),
        **extra, "wall_seconds": round(time.monotonic() - started, 3),
        "config": {k: v for k, v in dataclasses.asdict(config).items() if k != "storage_options"},
    }
    storage.put_atomic(fsspec.filesystem("file"), os.path.join(config.out, REPORT_NAME),
                       json.dumps(report, indent=2).encode())
    return report
