"""The job's side of the manifest (its format — schema, part files, readers — is `connectors.run`'s).

    ManifestWriter(run, attempt)   add(rows) / maybe_flush() / flush(): each flush commits one part file
    summarize(run, table=) -> Summary   counts by sample for `hsx status` and `hsx report`
    error_kind(error) -> str       a short category for grouping failure reasons

A sample's state is its last decisive row (connectors.run): "ok" (committed), "invalid" (hsx verify found its file
bad; a resume extracts it again), "skipped" (its states were refused under --on-nonfinite skip: final); a sample
with none of those but "failed" rows is failed, and a resume tries it again.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from connectors.manifest import (
    FAILED,
    INVALID,
    OK,
    SETTLED_COLUMNS,
    committed_rows,
    encode_manifest_part,
    live_manifest_parts,
    manifest_rows,
    read_manifest,
    settled_rows,
    skipped_rows,
)
from connectors.run import RunDir
from connectors.storage import retrying

logger = logging.getLogger(__name__)


class ManifestWriter:
    """Buffers result rows and commits them as atomic Parquet parts."""

    def __init__(self, run: RunDir, attempt: str, flush_rows: int = 1000, flush_seconds: float = 30.0,
                 retry_s: float | None = None) -> None:
        """`retry_s`: how long a commit that fails with a transient storage error is retried (None: not retried)."""
        self.run = run
        self.retry_s = retry_s
        self.attempt = attempt
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._unsent: tuple[str, bytes, int] | None = None  # a part whose put raised: (name, bytes, rows)
        self._seq = 0
        self._last_flush = time.monotonic()

    def add(self, rows: pa.Table) -> None:
        if rows.num_rows:
            self._pending.append(manifest_rows(rows))
            self._pending_rows += rows.num_rows

    def maybe_flush(self) -> bool:
        if self._pending_rows >= self.flush_rows or (
                self._pending_rows and time.monotonic() - self._last_flush >= self.flush_seconds):
            self.flush()
            return True
        return False

    def flush(self) -> None:
        """Commit every row added. A put that raised may still have landed (a timeout after the store took the
        object, a failed directory fsync), so its part is kept and the next flush puts the same name and bytes again,
        replacing it: never a second part with the same rows. Rows added meanwhile go into the next part."""
        self._last_flush = time.monotonic()
        if self._unsent is not None:
            self._put(*self._unsent)
        if self._pending_rows:
            name, raw = encode_manifest_part(pa.concat_tables(self._pending), self.attempt, self._seq)
            self._unsent = (name, raw, self._pending_rows)
            self._seq += 1
            self._pending, self._pending_rows = [], 0
            self._put(*self._unsent)

    def _put(self, name: str, raw: bytes, rows: int) -> None:
        # one attempt without retry_s; a put that raised may have landed: a retry puts the same name and bytes
        retrying("manifest commit", self.run.url_of(name), 1, 0.2, self.retry_s)(self.run.put, name, raw)
        self._unsent = None
        logger.debug("committed %d manifest rows to %s", rows, name)


@dataclass
class Summary:
    ok: int = 0
    """Samples with an "ok" row."""
    failed: int = 0
    """Samples whose rows all failed."""
    failed_for_good: int = 0
    """Of those, samples whose last failure repeats every time (a malformed record, ...): re-runs skip them unless
    --retry-failed."""
    invalid: int = 0
    """Samples whose committed file hsx verify found bad (not yet re-extracted)."""
    skipped: int = 0
    """Samples skipped for good: states refused (NaN/Inf, a layer of zeros) under --on-nonfinite skip."""
    rows: int = 0
    duplicate_ok_rows: int = 0
    """"ok" rows beyond one per sample (0 unless something broke exactly-once)."""
    truncated: int = 0
    tokens: int = 0
    bytes: int = 0
    shards: int = 0
    """Shard objects the committed samples lie in (--layout sharded); 0 when each has a file of its own."""
    parts: int = 0
    attempts: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)
    """(sample_id, error) of failed samples, first few."""
    skips: list[tuple[str, str]] = field(default_factory=list)
    """(sample_id, reason) of skipped samples, first few."""
    error_kinds: dict[str, int] = field(default_factory=dict)


def summarize(run: RunDir, max_errors: int = 10, table: pa.Table | None = None) -> Summary:
    """Counts by sample; `table`: the manifest when the caller has read it already (read here otherwise)."""
    table = read_manifest(run) if table is None else table
    s = Summary(rows=table.num_rows, parts=len(live_manifest_parts(run)))
    if not table.num_rows:
        return s
    s.attempts = len(pc.unique(table["attempt"]))
    ok = committed_rows(table)
    ok_ids = ok["sample_id"]
    s.ok = ok.num_rows
    s.tokens = int(pc.sum(ok["num_tokens"]).as_py() or 0)
    s.bytes = int(pc.sum(ok["bytes"]).as_py() or 0)
    s.shards = len(pc.unique(ok.filter(pc.is_valid(ok["offset"]))["path"]))
    s.truncated = int(pc.sum(pc.cast(ok["truncated"], pa.int64())).as_py() or 0)
    # "ok" rows beyond one per sample and per re-extraction after an "invalid" row: 0 unless exactly-once broke
    counts = table.group_by(["sample_id", "status"], use_threads=False).aggregate([("status", "count")]).to_pylist()
    per: dict[str, Counter] = {}
    for c in counts:
        per.setdefault(c["sample_id"], Counter())[c["status"]] = c["status_count"]
    committed = set(ok_ids.to_pylist())
    s.duplicate_ok_rows = sum(max(0, n[OK] - n[INVALID] - (sid in committed)) for sid, n in per.items())
    skipped = skipped_rows(table)
    s.skipped = skipped.num_rows
    s.skips = sorted(zip(skipped["sample_id"].to_pylist(), skipped["error"].to_pylist()))[:max_errors]
    settled = committed | set(skipped["sample_id"].to_pylist())
    invalid = [sid for sid, n in per.items() if n[INVALID] and sid not in settled]
    s.invalid = len(invalid)
    undone = pc.invert(pc.is_in(table["sample_id"], value_set=pa.array(sorted(settled | set(invalid)),
                                                                        pa.string())))
    failed = table.filter(pc.and_(pc.equal(table["status"], FAILED), undone))
    s.failed = len(pc.unique(failed["sample_id"]))
    s.failed_for_good = len(settled_rows(failed.select(list(SETTLED_COLUMNS))))  # their last row repeats every time
    seen: set[str] = set()
    kinds: Counter[str] = Counter()
    for sid, err in zip(failed["sample_id"].to_pylist(), failed["error"].to_pylist()):
        if sid in seen:
            continue
        seen.add(sid)
        kinds[error_kind(err or "")] += 1
        if len(s.errors) < max_errors:
            s.errors.append((sid, err or ""))
    s.error_kinds = dict(kinds.most_common())
    return s


def error_kind(error: str) -> str:
    """A short category for grouping failure reasons (the message after any "file:line: " prefix)."""
    text = error
    if "://" in text.split(" ", 1)[0] or text.startswith("/"):
        head, _, rest = text.partition(": ")
        text = rest or head
    kind = text.split(":", 1)[0].split("(", 1)[0].strip()
    return re.sub(r"\d+", "N", kind)[:60] or "unknown"
