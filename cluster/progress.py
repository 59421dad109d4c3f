"""What the user watches: a live progress bar while a job runs, and the end summary.

    Progress(enabled)      update(results) per result batch; set_total(n) once the corpus is counted; close()
    progress_bar(desc, unit, enabled), set_total(bar, n)    the bar itself (hsx regenerate's too)
    JobResult              the end-of-job numbers; .lines() renders the summary

The bar counts samples finished in this run (ok + failed + skipped) and shows samples/s (tqdm's rate), tokens/s, bytes
written and, once the corpus count is known, an ETA.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def human_count(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}T"


def progress_bar(desc: str, unit: str, enabled: bool = True, file=None):
    """A tqdm bar on stderr (or `file`) with no total yet: redrawn every half second on a terminal, a line every 30 s
    in a log (pod, CI)."""
    from tqdm.auto import tqdm

    file = file or sys.stderr
    interactive = hasattr(file, "isatty") and file.isatty()
    return tqdm(total=None, unit=unit, desc=desc, dynamic_ncols=interactive, smoothing=0.1, disable=not enabled,
                file=file, mininterval=0.5 if interactive else 30)


def set_total(bar, total: int) -> None:
    """The bar's total, once counted (never below what it has shown)."""
    bar.total = max(total, bar.n)
    bar.refresh()


class Progress:
    def __init__(self, enabled: bool = True, file=None) -> None:
        self.started = time.monotonic()
        self.ok = self.failed = self.skipped = self.tokens = self.bytes = 0
        self._bar = progress_bar("extracting", "sample", enabled, file)

    def set_total(self, total: int) -> None:
        set_total(self._bar, total)

    def update(self, results: pa.Table) -> None:
        status = results["status"]
        ok = int(pc.sum(pc.cast(pc.equal(status, "ok"), pa.int64())).as_py() or 0)
        skipped = int(pc.sum(pc.cast(pc.equal(status, "skipped"), pa.int64())).as_py() or 0)
        self.ok += ok
        self.skipped += skipped
        self.failed += results.num_rows - ok - skipped
        self.tokens += int(pc.sum(results["num_tokens"]).as_py() or 0)
        self.bytes += int(pc.sum(results["bytes"]).as_py() or 0)
        elapsed = max(time.monotonic() - self.started, 1e-9)
        skipped = f" skipped={self.skipped}" if self.skipped else ""
        self._bar.set_postfix_str(f"ok={self.ok} failed={self.failed}{skipped} {human_count(self.tokens / elapsed)} tok/s "
                                  f"{human_bytes(self.bytes)}", refresh=False)
        self._bar.update(results.num_rows)

    def close(self) -> None:
        self._bar.close()


@dataclass
class JobResult:
    output: str
    attempt: str
    ok: int = 0
    """Samples extracted in this run."""
    failed: int = 0
    """Samples that failed in this run (each has a manifest row with its reason)."""
    skipped: int = 0
    """Records skipped because an earlier run settled them (committed, or skipped for good)."""
    skipped_bad: int = 0
    """Samples skipped for good in this run: their states were refused (NaN/Inf, a layer of zeros) under
    --on-nonfinite skip; each has a "skipped" manifest row with its reason."""
    duplicates: int = 0
    """Records whose sample id another record already has (failed rows)."""
    truncated: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    new_run: bool = True
    failures: list[tuple[str, str]] = field(default_factory=list)
    """(sample_id, error) of the first failures."""
    skips: list[tuple[str, str]] = field(default_factory=list)
    """(sample_id, reason) of the first samples skipped for bad states."""
    regeneration: list[str] = field(default_factory=list)
    """--regenerate-with: hsx regenerate's summary."""
    gpus_per_worker: float | None = None
    cpus_per_worker: float | None = None
    """What each extraction worker reserved (a CPU worker runs that many torch threads, at most its node's cores)."""

    def workers_line(self) -> str:
        if self.gpus_per_worker is None:
            return "not started (nothing left to do)"
        if self.gpus_per_worker > 0:
            return f"{self.gpus_per_worker:g} GPU(s) and {self.cpus_per_worker:g} CPU(s) each"
        return f"on CPU, {self.cpus_per_worker:g} CPU(s) each"

    def lines(self) -> list[str]:
        secs = max(self.seconds, 1e-9)
        out = [
            f"hsx run {'finished' if self.new_run else 'resumed and finished'} in {self.seconds:.1f}s: "
            f"{self.ok} ok, {self.failed} failed"
            + (f", {self.skipped_bad} skipped for bad states" if self.skipped_bad else "")
            + f", {self.skipped} skipped (already done)"
            + (f", {self.truncated} truncated" if self.truncated else ""),
            f"  {human_count(self.tokens)} tokens, {human_bytes(self.bytes)} written; "
            f"{self.ok / secs:.1f} samples/s, {human_count(self.tokens / secs)} tokens/s",
            f"  workers:  {self.workers_line()}",
            f"  output:   {self.output}",
            f"  manifest: {self.output.rstrip('/')}/manifest  (pyarrow.parquet.read_table)",
        ]
        if self.failures:
            out.append(f"  first failures ({len(self.failures)} of {self.failed}):")
            out += [f"    {sid}: {err}" for sid, err in self.failures]
        out += [f"  {line}" for line in self.regeneration]
        if self.skips:
            out.append(f"  first skipped for bad states ({len(self.skips)} of {self.skipped_bad}; final, not extracted "
                       "again):")
            out += [f"    {sid}: {why}" for sid, why in self.skips]
        return out
