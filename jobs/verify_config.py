"""`hsx verify`'s settings (VerifyConfig), apart from the checks so that the CLI's parser builds without pyarrow or
torch (jobs/verify.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from connectors.storage import parse_storage_options


@dataclass(frozen=True)
class VerifyConfig:
    """One `hsx verify OUTPUT` (field `recompute` = flag `--recompute`)."""

    output: str
    """The run: an extraction OUTPUT folder or URL (holds run.json and manifest/)."""
    sample: int | None = None
    """Check N committed samples drawn at random (with --seed) instead of all of them."""
    all: bool = False
    """Check every committed sample (the default when --sample is not given)."""
    recompute: int = 0
    """Recompute the states of K of the checked samples with a plain transformers forward and compare."""
    seed: int = 0
    """Seed of the random draws (--sample, --recompute)."""
    tolerance: float | None = None
    """Largest allowed difference per layer, relative to the layer's largest magnitude; default 1e-3 for float32
    runs, 5e-2 for bfloat16/float16 (other kernels, other batch shapes)."""
    model_dir: str | None = None
    """The target model's local folder for --recompute; default the run's model when it is a local folder."""
    device: str = "cpu"
    """Device of the recompute forward (cpu, cuda, cuda:1)."""
    mark: bool = True
    """Mark failed samples "invalid" in the manifest so that re-running the same `hsx run` re-extracts them."""
    report: str | None = None
    """Also write the JSON report to this local path (it always goes to OUTPUT/verify/)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for OUTPUT, as JSON (endpoint, credentials)."""

    def __post_init__(self) -> None:
        if not self.output:
            raise ValueError("OUTPUT is empty; pass the run's output folder or URL (it holds run.json and manifest/)")
        if self.sample is not None and self.all:
            raise ValueError("--sample N and --all exclude each other; pass one (no flag: --all)")
        if self.sample is not None and self.sample < 1:
            raise ValueError(f"--sample must be >= 1, got {self.sample}")
        if self.recompute < 0:
            raise ValueError(f"--recompute must be >= 0, got {self.recompute}")
        if self.tolerance is not None and not self.tolerance > 0:
            raise ValueError(f"--tolerance must be > 0, got {self.tolerance}")
        object.__setattr__(self, "storage_options", parse_storage_options(self.storage_options))
