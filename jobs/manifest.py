"""The manifest: a Parquet dataset under OUTPUT/manifest/, one row per sample attempt. It is authoritative.

    ManifestWriter(output, attempt)     add(rows) / maybe_flush() / flush(): each flush commits one part file
    read_manifest(output) -> pa.Table   `pyarrow.parquet.read_table("OUTPUT/manifest")` reads the same thing
    committed_ids(output) -> set        sample ids with an "ok" row: a resume skips them
    summarize(output) -> Summary        counts by sample for `hsx status`

Exactly-once rests on two orderings. A sample's data file is durable before the worker reports it (the engine
returns only after its writes complete, and the worker re-reads the file's header), and its "ok" row is written only
after that, in a part file that appears atomically (temp + rename locally, a single put on object stores). So an
"ok" row always points at a complete file; a file with no row (the job died in between) is an orphan that no reader
counts and the next run overwrites; a resume skips exactly the ids with "ok" rows. Failed samples are retried on
resume; a sample's status is "ok" if any of its rows is ok, else "failed".
"""

from __future__ import annotations

import io
import logging
import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jobs.layout import MANIFEST_DIR, Output

logger = logging.getLogger(__name__)

# Rows produced by workers; the writer adds `attempt` and `committed_at`.
RESULT_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("status", pa.string()),            # "ok" | "failed"
    ("path", pa.string()),              # data file relative to OUTPUT; null when failed
    ("num_tokens", pa.int64()),         # rows stored (prompt, plus generated tokens when included)
    ("num_prompt_tokens", pa.int64()),
    ("bytes", pa.int64()),              # file size
    ("error", pa.string()),             # why it failed; null when ok
    ("source", pa.string()),            # corpus file and line/row
    ("truncated", pa.bool_()),          # over-length sample cut to the limit
])
MANIFEST_SCHEMA = RESULT_SCHEMA.append(pa.field("attempt", pa.string())).append(
    pa.field("committed_at", pa.timestamp("ms", tz="UTC")))
OK, FAILED = "ok", "failed"


def new_attempt_id() -> str:
    """Sorts by start time; unique across concurrent or repeated runs."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


class ManifestWriter:
    """Buffers result rows and commits them as atomic Parquet parts."""

    def __init__(self, output: Output, attempt: str, flush_rows: int = 1000, flush_seconds: float = 30.0) -> None:
        self.output = output
        self.attempt = attempt
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._seq = 0
        self._last_flush = time.monotonic()
        self.rows_committed = 0

    def add(self, rows: pa.Table) -> None:
        if rows.num_rows:
            self._pending.append(rows.select(RESULT_SCHEMA.names).cast(RESULT_SCHEMA))
            self._pending_rows += rows.num_rows

    def maybe_flush(self) -> bool:
        if self._pending_rows >= self.flush_rows or (
                self._pending_rows and time.monotonic() - self._last_flush >= self.flush_seconds):
            self.flush()
            return True
        return False

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._pending_rows:
            return
        table = pa.concat_tables(self._pending)
        n = table.num_rows
        now = pa.array([int(time.time() * 1000)] * n, pa.timestamp("ms", tz="UTC"))
        table = table.append_column("attempt", pa.array([self.attempt] * n, pa.string())).append_column(
            "committed_at", now)
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        name = f"{MANIFEST_DIR}/part-{self.attempt}-{self._seq:06d}.parquet"
        self.output.put_atomic(name, buf.getvalue())
        self._seq += 1
        self._pending, self._pending_rows = [], 0
        self.rows_committed += n
        logger.debug("committed %d manifest rows to %s", n, name)


def read_manifest(output: Output, columns: list[str] | None = None) -> pa.Table:
    """Every committed row (empty table when there is no manifest yet)."""
    parts = [n for n in output.list(MANIFEST_DIR) if n.endswith(".parquet")]
    if not parts:
        schema = MANIFEST_SCHEMA if columns is None else pa.schema([MANIFEST_SCHEMA.field(c) for c in columns])
        return schema.empty_table()
    tables = []
    for name in parts:
        with output.fs.open(output.path(f"{MANIFEST_DIR}/{name}"), "rb") as f:
            tables.append(pq.read_table(f, columns=columns))
    return pa.concat_tables(tables, promote_options="default")


def committed_ids(output: Output) -> set[str]:
    table = read_manifest(output, columns=["sample_id", "status"])
    ok = table.filter(pc.equal(table["status"], OK))
    return set(ok["sample_id"].to_pylist())


@dataclass
class Summary:
    ok: int = 0
    """Samples with an "ok" row."""
    failed: int = 0
    """Samples whose rows all failed."""
    rows: int = 0
    duplicate_ok_rows: int = 0
    """"ok" rows beyond one per sample (0 unless something broke exactly-once)."""
    truncated: int = 0
    tokens: int = 0
    bytes: int = 0
    parts: int = 0
    attempts: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)
    """(sample_id, error) of failed samples, first few."""
    error_kinds: dict[str, int] = field(default_factory=dict)


def summarize(output: Output, max_errors: int = 10) -> Summary:
    table = read_manifest(output)
    s = Summary(rows=table.num_rows, parts=len([n for n in output.list(MANIFEST_DIR) if n.endswith(".parquet")]))
    if not table.num_rows:
        return s
    s.attempts = len(pc.unique(table["attempt"]))
    ok = table.filter(pc.equal(table["status"], OK))
    ok_ids = pc.unique(ok["sample_id"])
    s.ok = len(ok_ids)
    s.duplicate_ok_rows = ok.num_rows - s.ok
    s.tokens = int(pc.sum(ok["num_tokens"]).as_py() or 0)
    s.bytes = int(pc.sum(ok["bytes"]).as_py() or 0)
    s.truncated = int(pc.sum(pc.cast(ok["truncated"], pa.int64())).as_py() or 0)
    failed = table.filter(pc.and_(pc.equal(table["status"], FAILED),
                                  pc.invert(pc.is_in(table["sample_id"], value_set=ok_ids))))
    failed_ids = pc.unique(failed["sample_id"])
    s.failed = len(failed_ids)
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
