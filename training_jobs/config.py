"""TrainJobConfig: `hsx train-drafter`'s settings, typed and validated. It extends training.train_config's
TrainDrafterConfig (what one process needs to train on a stored run) with the settings that train on Ray, as
jobs.config.JobConfig extends extractor.options.EngineOptions: flags map one to one onto its fields.

    TrainJobConfig(...)          validated in __post_init__ (the trainer's checks, then these); errors name the flag
    config.distributed()         --workers > 1 or an --address: data-parallel replicas on Ray Train (training_jobs/train.py)
    --online / --fanout          a live extraction feeds one trainer (training_jobs/live.py) or several (training_jobs/fanout.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from training.train_config import TrainDrafterConfig, json_object


@dataclass(frozen=True)
class TrainJobConfig(TrainDrafterConfig):
    """A drafter training (`hsx train-drafter`: field `batch_tokens` = flag `--batch-tokens`), in this process or on
    Ray: the trainer's settings (training.train_config.TrainDrafterConfig) and these."""

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
    "1,2,4", "max_tokens": 64, "include_output_tokens": true, "workers": 2}'). Without layers: those the --kind
    (or --fanout's kinds) reads, or `hsx run`'s default with --cache."""
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

    def __post_init__(self) -> None:
        if isinstance(self.corpus, str):
            object.__setattr__(self, "corpus", (self.corpus,))
        object.__setattr__(self, "corpus", tuple(str(c) for c in self.corpus))
        object.__setattr__(self, "extract", json_object(self.extract, "extract"))
        super().__post_init__()
        if self.online:
            self._check_online()
        elif self.corpus or self.extract or self.cache or self.fanout:
            raise ValueError("--corpus, --extract, --cache and --fanout belong to --online training; without "
                             "--online, train on --run")
        if self.workers < 1 or self.max_failures < 0:
            raise ValueError(f"--workers must be >= 1 and --max-failures >= 0, got {self.workers} and "
                             f"{self.max_failures}")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ValueError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")
        if self.distributed() and self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device {self.device!r} with --workers {self.workers}: Ray gives each replica its "
                             "device; use --gpus-per-worker (and --device auto, cpu or cuda)")

    def _check_online(self) -> None:
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

    def distributed(self) -> bool:
        """Whether this training runs on Ray (training_jobs.train): --workers > 1 or an --address."""
        return self.workers > 1 or bool(self.address)

    def reads_run(self) -> bool:
        return not self.online

    def session_key(self) -> dict[str, Any]:
        return {"workers": self.workers, "online": self.online}

    def input_folders(self) -> dict[str, str]:
        return {**super().input_folders(), **({"--cache": self.cache} if self.cache else {})}
