"""`hsx report`'s settings (ReportConfig), apart from the report so that the CLI's parser builds without pyarrow,
torch or matplotlib (jobs/report.py draws the page)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from connectors.storage import parse_storage_options


@dataclass(frozen=True)
class ReportConfig:
    """`hsx report OUTPUT`."""

    output: str = field(metadata={"cli": {"positional": True}})
    """The run's output folder or URL."""
    out: str = "report.html"
    """Where to write the page (a local file)."""
    sample: int = 64
    """Committed samples whose files are read for the state, mask and zero-row figures (drawn at random)."""
    seed: int = 0
    """Seed of the sample draw (the same seed, the same samples)."""
    max_positions: int = 512
    """Token positions charted per sample (the first ones)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for OUTPUT, as JSON (e.g. '{"anon": true}')."""
    snapshot: bool = False
    """Draw a run that an `hsx run` is writing now (a live writer.lease): the rows committed at this moment, said so
    on the page. Without it such a run is refused."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "storage_options", parse_storage_options(self.storage_options, "--storage-options"))
        if self.sample < 0:
            raise ValueError(f"--sample must be >= 0, got {self.sample}")
        if self.max_positions < 1:
            raise ValueError(f"--max-positions must be >= 1, got {self.max_positions}")
