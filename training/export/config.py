"""`ExportConfig`: one `hsx export`, typed and validated; the CLI's flags map onto it one to one. Imports no torch,
so building the `hsx` parser stays cheap."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from connectors.storage import parse_storage_options

FORMATS = ("speculators", "specforge", "modelopt")


@dataclass(frozen=True)
class ExportConfig:
    """One export (`hsx export OUTPUT DEST --format ...`); the CLI's flags map one to one onto these fields."""

    output: str
    """The run: an extraction OUTPUT folder or URL (holds run.json and manifest/)."""
    dest: str
    """Local folder to write the trainer's layout into; created if missing, resumed if it holds a partial export."""
    format: str
    """Target trainer's layout: speculators, specforge or modelopt."""
    model_dir: str | None = None
    """Target model's local folder, for its final norm (specforge/modelopt need the last layer post-norm; default:
    the run's model when it is a local folder)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for reading OUTPUT, as JSON (e.g. {"client_kwargs": {"endpoint_url": "http://..."}})."""
    num_workers: int = 0
    """DataLoader worker processes reading samples ahead of the writer (0: read in the writing process)."""
    break_lease: bool = False
    """Take DEST over from another export that looks alive (only when that one is known to be gone)."""
    snapshot: bool = False
    """Export a run that an `hsx run` is writing now: what it has committed so far (hsx_export.json says so and
    names the writer). Without it, such a run is refused."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown export format {self.format!r}; choose one of {list(FORMATS)} (--format)")
        if not self.output:
            raise ValueError("OUTPUT is empty; pass the run's output folder or URL (it holds run.json and manifest/)")
        if not self.dest or "://" in str(self.dest):
            raise ValueError(f"DEST {self.dest!r} must be a local folder (trainers read these layouts from disk)")
        object.__setattr__(self, "storage_options", parse_storage_options(self.storage_options))
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
