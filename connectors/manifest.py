"""The manifest: the authoritative record of what a run committed, one Parquet part per commit.

    OUTPUT/manifest/part-<attempt>-<seq>-xxh3_64_<hex>.parquet
        MANIFEST_SCHEMA rows, one part per commit; a data file counts only with an "ok" row; <hex> (16 digits) is
        the xxh3_64 of the part's bytes, checked on every read (a flipped byte in a Parquet page or footer can
        otherwise read back as other data); parts named without it (older runs) read unchecked
    OUTPUT/manifest/_compaction-<attempt>.json
        a compaction's commit record: the parts it wrote and the parts they supersede

    RESULT_SCHEMA, MANIFEST_SCHEMA, OK, FAILED, INVALID, SKIPPED, REQUIRED_COLUMNS, new_attempt_id()
    row_path_problem(rel)                          why a row's path cannot be read (absolute, `..`, missing), or None
    row_file_problem(info, sample_id, num_tokens, checksum, size=)   (kind, why) a file is not its row's, or None
    manifest_rows(rows) / encode_manifest_part(rows, attempt, seq)   rows in RESULT_SCHEMA; one part's name and bytes
    write_manifest_part(run, rows, attempt, seq)   one atomic part (the part writer; encode_manifest_part + put)
    read_manifest(run, columns)                    every committed row (of the live parts)
    read_manifest_part(run, name, columns)         the rows of one part (readers following a growing manifest)
    manifest_parts(run)                            the part files listed, compacted or not
    referenced_paths(run, prefix)                  the distinct paths rows point at (shards), part by part
    live_manifest_parts(run)                       the parts read: all, less what a compaction superseded
    compact_manifest(run) -> Compaction            merge the parts into a few large sorted ones, atomically
    committed_rows(table)                          per sample its last "ok" row, unless "invalid" came after it
    skipped_rows(table)                            per sample its last "skipped" row, unless "ok"/"invalid" came after
    ok_rows(run)                                   the committed rows, sorted by sample id
    sample_range(offset, length)                   a row's byte range in a shard, or None for a file of its own
    committed_ids(run)                             ids of committed samples
    settled_ids(run) / settled_rows(table)         ids a resume skips: committed, skipped, or failing for good

Exactly-once rests on two orderings. A sample's data file is durable (written, fsynced, renamed, directory fsynced)
before its "ok" row is written, and that row is committed in a part file that appears atomically and durably (the
same `storage.put_atomic`). So an "ok" row always points at a complete file; a file with no row (the job died in
between) is an orphan no reader counts and the next run overwrites. The output root, run.json and the data files'
names are `connectors.run`'s. This module never imports torch, transformers or ray.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from connectors.folders import MANIFEST_DIR, RUN_JSON
from connectors.format import CHECKSUM_ALGORITHM, data_checksum
from connectors.run import RunDir, RunFormatError, as_run_dir

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


# Rows produced by workers; the part writer adds `attempt` and `committed_at`.
RESULT_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("status", pa.string()),            # "ok" | "failed" | "invalid" (hsx verify found the committed file bad) |
                                        # "skipped" (refused on purpose, final: --on-nonfinite skip)
    ("path", pa.string()),              # data file (or shard) relative to OUTPUT; null unless ok
    ("num_tokens", pa.int64()),         # rows stored (prompt, plus generated tokens when included)
    ("num_prompt_tokens", pa.int64()),
    ("bytes", pa.int64()),              # file size (in a shard: the sample's length there)
    ("error", pa.string()),             # why it failed or was skipped; null when ok
    ("source", pa.string()),            # corpus file and line/row
    ("truncated", pa.bool_()),          # over-length sample cut to the limit
    ("checksum", pa.string()),          # the file's data checksum ("xxh3_64:<hex>"), as its header records it
    ("retry", pa.bool_()),              # failed rows: false when the record fails the same way every time (malformed,
                                        # no known field, over-length, ...): a re-run skips it unless --retry-failed;
                                        # true or null (older runs): a re-run extracts it again
    ("offset", pa.int64()),             # --layout sharded: where the sample's bytes start in the shard `path`
                                        # (they run for `bytes`); null for a file of its own
])
MANIFEST_SCHEMA = RESULT_SCHEMA.append(pa.field("attempt", pa.string())).append(
    pa.field("committed_at", pa.timestamp("ms", tz="UTC")))
OK, FAILED, INVALID, SKIPPED = "ok", "failed", "invalid", "skipped"
"""A sample's outcome: "ok" (its file is committed); "failed" (nothing committed; a resume tries again); "invalid"
(hsx verify found the committed file bad; a resume extracts it again); "skipped" (nothing committed, on purpose and
for good: its states were refused under --on-nonfinite skip, and no resume extracts it again)."""
REQUIRED_COLUMNS = ("sample_id", "path", "num_tokens", "status")
"""What a reader of "ok" samples needs; the rest may be null."""


def row_path_problem(rel: object) -> str | None:
    """Why a manifest row's `path` cannot name a data file of its run, or None: it must be a relative path inside
    OUTPUT (what the job writes), never absolute, a URL, or a way out through `..` (a damaged or planted manifest
    would otherwise have readers open files outside the run)."""
    if not rel:
        return "the manifest row has no path (the manifest was damaged or written by other code)"
    if not isinstance(rel, str):
        return f"the manifest row's path is {type(rel).__name__}, not a string (a damaged manifest)"
    if rel.startswith("/") or "://" in rel or "\\" in rel or any(seg in ("", ".", "..") for seg in rel.split("/")):
        return (f"the manifest row's path {rel!r} is not a plain relative path inside the run (absolute, a URL, or "
                "with '..' or empty segments): the manifest was damaged or written by other code")
    return None


def row_file_problem(info, sample_id: str, num_tokens: int | None, checksum: str | None, *,
                     size: int | None = None) -> tuple[str, str] | None:
    """Why the file whose header is `info` (connectors.header.HiddenStatesFileInfo) is not the one its manifest row
    commits — ("sample id" | "size" | "tokens" | "checksum", what differs) — or None. A header without a sample id
    (vLLM's files), a row without a size or a checksum (older runs) is not compared on that field. What `hsx
    verify` and the training feed both check."""
    recorded = info.metadata.get("sample_id")
    if recorded is not None and recorded != sample_id:
        return "sample id", f"the file holds sample {recorded!r}, not the manifest row's {sample_id!r}"
    if size is not None and info.size != size:
        return "size", f"the file has {info.size} bytes, the manifest row says {size}"
    if info.num_tokens != num_tokens:
        return "tokens", f"the file holds {info.num_tokens} tokens, the manifest says {num_tokens}"
    if checksum and info.checksum != checksum:
        return "checksum", f"the file records checksum {info.checksum}, the manifest row {checksum}"
    return None


def new_attempt_id() -> str:
    """Sorts by start time, to the microsecond (part names order commits, see committed_rows); unique across
    concurrent or repeated runs."""
    now = time.time()
    return (time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z-"
            + uuid.uuid4().hex[:8])


def manifest_rows(rows: pa.Table | Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows in RESULT_SCHEMA: a table or dicts; columns other than sample_id and status may be left out (null)."""
    if not isinstance(rows, pa.Table):
        rows = pa.Table.from_pylist([dict(r) for r in rows]) if len(rows) else RESULT_SCHEMA.empty_table()
    missing = [n for n in ("sample_id", "status") if n not in rows.column_names]
    if missing:
        raise ValueError(f"manifest rows lack {missing}; every row needs a sample_id and a status ('ok'/'failed')")
    columns = [rows[f.name].cast(f.type) if f.name in rows.column_names else pa.nulls(rows.num_rows, f.type)
               for f in RESULT_SCHEMA]
    return pa.Table.from_arrays(columns, schema=RESULT_SCHEMA)


def encode_manifest_part(rows: pa.Table | Sequence[Mapping[str, Any]], attempt: str, seq: int) -> tuple[str, bytes]:
    """One part file for `rows`: (its name relative to the root, its bytes). The name carries the checksum of the
    bytes, which hold the commit time: a retry of a commit that may have landed must put these same two again (then
    it replaces the part), not encode the rows anew (a second part with the same rows)."""
    table = manifest_rows(rows)
    n = table.num_rows
    now = pa.array([int(time.time() * 1000)] * n, pa.timestamp("ms", tz="UTC"))
    table = table.append_column("attempt", pa.array([attempt] * n, pa.string())).append_column("committed_at", now)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    raw = sink.getvalue().to_pybytes()
    return f"{MANIFEST_DIR}/part-{attempt}-{seq:06d}-{CHECKSUM_ALGORITHM}_{_part_digest(raw)}.parquet", raw


def _part_digest(raw: bytes) -> str:
    """The hex digits a part's name carries: the data checksum of its bytes, without the algorithm tag."""
    return data_checksum([raw]).split(":", 1)[1]


def write_manifest_part(run: RunDir | str, rows: pa.Table | Sequence[Mapping[str, Any]], attempt: str, seq: int, *,
                        storage_options: dict | None = None) -> str:
    """Commit `rows` as one part file (atomic and durable); returns its name relative to the root."""
    run = as_run_dir(run, storage_options)
    name, raw = encode_manifest_part(rows, attempt, seq)
    run.put(name, raw)
    return name


# The checksum a part's name carries (encode_manifest_part): "-<algorithm>_<hex>.parquet"; parts of older runs carry
# none. A name with a checksum tag this hsx does not know is refused, not read unchecked.
_PART_CHECKSUM_RE = re.compile(r"-(xxh3_\w+?)_([0-9a-f]+)\.parquet$")


def manifest_parts(run: RunDir) -> list[str]:
    return [n for n in run.list(MANIFEST_DIR) if n.endswith(".parquet")]


def read_manifest(run: RunDir | str, columns: Sequence[str] | None = None, *,
                  storage_options: dict | None = None) -> pa.Table:
    """Every committed row (an empty table when there is no manifest yet), in commit order. Columns a part lacks
    read as null. Reads the live parts only (see `live_manifest_parts`); a part removed by a compaction while it was
    being read makes the read start over from a fresh listing, so a reader never sees a gap or a duplicate."""
    run = as_run_dir(run, storage_options)
    schema = MANIFEST_SCHEMA if columns is None else pa.schema([MANIFEST_SCHEMA.field(c) for c in columns])

    def read() -> pa.Table:
        parts = live_manifest_parts(run)
        if not parts:
            return schema.empty_table()
        if len(parts) == 1:
            return _read_part(run, parts[0], schema)
        # many small parts on an object store: fetch them concurrently
        with concurrent.futures.ThreadPoolExecutor(min(16, len(parts)), thread_name_prefix="hsx-manifest") as pool:
            return pa.concat_tables(list(pool.map(lambda name: _read_part(run, name, schema), parts)))

    return _again_if_compacted(run, read)


_MANIFEST_READ_TRIES = 5


def _again_if_compacted(run: RunDir, read: Callable[[], _T]) -> _T:
    """`read()`, started over (up to _MANIFEST_READ_TRIES times) when a part or record it listed went away under it
    (a compaction replaced it): what every manifest reader does so that it never sees a gap or a duplicate."""
    for attempt in range(_MANIFEST_READ_TRIES):
        try:
            return read()
        except _PartGone:
            if attempt == _MANIFEST_READ_TRIES - 1:
                raise
            logger.debug("the manifest of %s changed while being read (a compaction); reading again", run.url)
    raise AssertionError("unreachable")


def referenced_paths(run: RunDir | str, prefix: str, *, storage_options: dict | None = None) -> set[str]:
    """The distinct `path` values under `prefix` of every manifest row (any status), read one part at a time: memory
    grows with the distinct paths (a run's shards), not with its rows."""
    run = as_run_dir(run, storage_options)
    schema = pa.schema([MANIFEST_SCHEMA.field("path")])

    def read() -> set[str]:
        found: set[str] = set()
        for name in live_manifest_parts(run):
            paths = pc.unique(_read_part(run, name, schema)["path"].drop_null())
            found.update(p for p in paths.to_pylist() if p.startswith(prefix))
        return found

    return _again_if_compacted(run, read)


def read_manifest_part(run: RunDir | str, name: str, columns: Sequence[str] | None = None, *,
                       storage_options: dict | None = None) -> pa.Table:
    """The rows of one manifest part (a name from live_manifest_parts), its checksum checked: for readers that follow
    a manifest part by part as it grows."""
    run = as_run_dir(run, storage_options)
    return _read_part(run, name, MANIFEST_SCHEMA if columns is None else
                      pa.schema([MANIFEST_SCHEMA.field(c) for c in columns]))


class _PartGone(RunFormatError):
    """A listed manifest part was gone when read: a compaction replaced it in the meantime (the read starts over)."""


def _read_part(run: RunDir, name: str, schema: pa.Schema) -> pa.Table:
    """One part, whole (a storage error is told from damage; the checksum in its name checked), as `schema`."""
    where = run.url_of(f"{MANIFEST_DIR}/{name}")
    try:
        raw = run.read_bytes(f"{MANIFEST_DIR}/{name}")
    except FileNotFoundError as e:
        raise _PartGone(f"manifest part {where} was removed while the manifest was read (a compaction replaced it); "
                        "run the command again") from e
    except OSError as e:
        detail = " ".join(str(e).split())
        raise RunFormatError(f"cannot read manifest part {where}: {type(e).__name__}: {detail}; check that the "
                             "storage answers, then run the command again") from e
    damaged = (f"hsx commits a part whole, so it was damaged in storage: rename it to {name}.damaged (out of "
               "the manifest), re-run the same `hsx run`, which extracts the samples it recorded again, and "
               "`hsx verify` again if the run was verified (its marks may have been in that part)")
    named = _PART_CHECKSUM_RE.search(name)
    if named and named.group(1) != CHECKSUM_ALGORITHM:
        raise RunFormatError(f"manifest part {where} carries a {named.group(1)} checksum, which this hsx does "
                             f"not know (it writes and checks {CHECKSUM_ALGORITHM}); read the run with the hsx "
                             "that wrote it, or a newer one")
    if named and (actual := _part_digest(raw)) != named.group(2):
        raise RunFormatError(f"manifest part {where} does not match the {CHECKSUM_ALGORITHM} checksum in its "
                             f"name (its {len(raw)} bytes hash to {CHECKSUM_ALGORITHM}:{actual}); {damaged}")
    try:
        part = pq.ParquetFile(pa.BufferReader(raw))
        names = part.schema_arrow.names
        missing = [c for c in REQUIRED_COLUMNS if c not in names]
        if missing:
            raise RunFormatError(f"manifest at {run.url_of(MANIFEST_DIR)} lacks columns {missing} (it has "
                                 f"{names}); it was not written by an hsx extraction job")
        # use_threads=False: parts are read concurrently by our own pool; Arrow's CPU pool left alive at exit aborts
        # the process now and then ("terminate called without an active exception", apache/arrow#34314)
        table = part.read(columns=[c for c in schema.names if c in names], use_threads=False)
        return pa.Table.from_arrays(
            [table[f.name].cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
             for f in schema], schema=schema)
    except RunFormatError:
        raise
    # pyarrow raises OSError for a damaged footer or page too, and damaged metadata can fail as text or types
    except (pa.ArrowException, OSError, ValueError) as e:
        detail = " ".join(str(e).split())
        raise RunFormatError(
            f"manifest part {where} is not readable Parquet ({type(e).__name__}: {detail}); {damaged}") from e


# -- compaction -------------------------------------------------------------------------------------------------

COMPACTION_PREFIX = "_compaction-"
"""manifest/_compaction-<attempt>.json (pyarrow, reading the folder as a dataset, skips "_" names): the commit record of a compaction ({"parts": [its parts], "supersedes":
[the parts they replace], "rows": n}). Written after its parts, atomically: it is the switch. Parts of a compaction
without its record (one that died) are not read; parts a record supersedes are not read (and are removed after)."""
_COMPACTED_PART_RE = re.compile(r"^part-.+-c\d{6}-")
COMPACTED_PART_ROWS = 2_000_000
"""Rows per part a compaction writes (parts are read concurrently; each is one sorted range of sample ids)."""


def live_manifest_parts(run: RunDir | str, *, storage_options: dict | None = None) -> list[str]:
    """The part files whose rows make the manifest, in commit order (by name): every part, less those a compaction
    record supersedes and the parts of a compaction that has no record (it did not finish)."""
    run = as_run_dir(run, storage_options)
    return _again_if_compacted(run, lambda: _live_parts(run))  # a record removed after the listing: list again


def _live_parts(run: RunDir) -> list[str]:
    names = run.list(MANIFEST_DIR)
    members: set[str] = set()
    superseded: set[str] = set()
    for record in (n for n in names if n.startswith(COMPACTION_PREFIX) and n.endswith(".json")):
        try:
            doc = json.loads(run.read_bytes(f"{MANIFEST_DIR}/{record}"))
            members.update(doc["parts"])
            superseded.update(doc["supersedes"])
        except FileNotFoundError as e:
            raise _PartGone(f"the compaction record {record} was removed while the manifest was listed") from e
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise RunFormatError(f"the compaction record {run.url_of(f'{MANIFEST_DIR}/{record}')} is unreadable "
                                 f"({type(e).__name__}: {e}); hsx writes it whole, so it was damaged in storage: "
                                 "restore it from a backup, or move it and the parts it names away and run "
                                 "`hsx compact` again") from e
    return [n for n in names if n.endswith(".parquet") and n not in superseded
            and (n in members or not _COMPACTED_PART_RE.match(n))]


@dataclass(frozen=True)
class Compaction:
    """What `compact_manifest` did."""

    parts_before: int
    parts_after: int
    rows: int
    removed: int
    """Superseded parts (and older records) removed from storage."""


def compact_manifest(run: RunDir | str, *, rows_per_part: int = COMPACTED_PART_ROWS, min_parts: int = 2,
                     storage_options: dict | None = None) -> Compaction:
    """Merge the live manifest parts into a few large ones: every row kept, in commit order within each sample and
    sorted by sample id across them (a stable sort, so each sample's last row is still its decisive one), written
    as parts named by a new attempt (so they sort before any later commit), then switched to at once by writing the
    compaction record, then the parts it supersedes removed. Readers see the old parts or the new ones, never both,
    never neither. Nothing is done when fewer than `min_parts` parts are live. The caller holds the writer lease
    (one writer: a job commits no part meanwhile)."""
    run = as_run_dir(run, storage_options)
    if rows_per_part < 1:
        raise ValueError(f"rows_per_part must be >= 1, got {rows_per_part}")
    before = live_manifest_parts(run)
    if len(before) < max(1, min_parts):
        return Compaction(len(before), len(before), -1, 0)
    table = read_manifest(run)
    live = live_manifest_parts(run)
    if live != before:
        raise RunFormatError(f"the manifest of {run.url} changed while it was compacted (another writer?); hold "
                             "the writer lease (one writer per output) and compact again")
    table = table.take(pc.sort_indices(table, sort_keys=[("sample_id", "ascending")]))  # stable: commit order kept
    attempt = new_attempt_id()
    names = []
    for i, start in enumerate(range(0, max(table.num_rows, 1), rows_per_part)):
        sink = pa.BufferOutputStream()
        # dictionaries only where values repeat: on unique strings (ids, paths, checksums) they double the decode time
        pq.write_table(table.slice(start, rows_per_part), sink, compression="zstd", row_group_size=128 * 1024,
                       use_dictionary=["status", "attempt", "error"])
        raw = sink.getvalue().to_pybytes()
        name = f"part-{attempt}-c{i:06d}-{CHECKSUM_ALGORITHM}_{_part_digest(raw)}.parquet"
        run.put(f"{MANIFEST_DIR}/{name}", raw)
        names.append(name)
    listed = run.list(MANIFEST_DIR)
    records = [n for n in listed if n.startswith(COMPACTION_PREFIX) and n.endswith(".json")]
    unfinished = [n for n in listed if _COMPACTED_PART_RE.match(n) and n not in before and n not in names]
    record = f"{COMPACTION_PREFIX}{attempt}.json"
    run.put(f"{MANIFEST_DIR}/{record}", json.dumps({"parts": names, "supersedes": before, "rows": table.num_rows},
                                                   indent=1).encode())
    removed = 0
    # the record above is the switch: what it supersedes, older records and the parts of compactions that never
    # wrote theirs are read by no one
    for name in [*before, *records, *unfinished]:
        try:
            run.fs.rm(run.path(f"{MANIFEST_DIR}/{name}"))
            removed += 1
        except FileNotFoundError:
            pass
        except OSError as e:  # left behind: superseded, so never read; the next compaction tries again
            logger.warning("could not remove the superseded manifest part %s: %s", name, e)
    return Compaction(len(before), len(names), table.num_rows, removed)


def _decisive_rows(table: pa.Table) -> pa.Table:
    """Per sample, its last row among those that decide its state ("ok", "invalid", "skipped"); a "failed" row never
    undoes an earlier decision (a later record with the same id fails as a duplicate). Rows count in commit order
    (parts by name, then row)."""
    is_decisive = pc.is_in(table["status"], pa.array([OK, INVALID, SKIPPED]))
    if _sorted_by_id(table):  # a compacted manifest: each sample's rows together, in commit order; no hashing
        rows = np.flatnonzero(is_decisive.to_numpy(zero_copy_only=False))  # [D] decisive rows, in order
        ids = table["sample_id"] if len(rows) == table.num_rows else table["sample_id"].take(rows)
        last = np.ones(len(rows), dtype=bool)  # the decisive row that is its sample's last
        if len(rows) > 1:
            last[:-1] = pc.not_equal(ids.slice(0, len(rows) - 1), ids.slice(1)).to_numpy(zero_copy_only=False)
        keep = rows[last]
        return table if len(keep) == table.num_rows else table.take(keep)
    decisive = table.filter(is_decisive)
    if decisive.num_rows == 0:
        return decisive
    decisive = decisive.append_column("_row", pa.array(np.arange(decisive.num_rows, dtype=np.int64)))
    last = decisive.group_by("sample_id", use_threads=False).aggregate([("_row", "max")])["_row_max"]
    return decisive.take(last).drop_columns(["_row"])


def committed_rows(table: pa.Table) -> pa.Table:
    """Per sample, its last "ok" row — unless an "invalid" row (hsx verify found the file bad) came after it: such a
    sample is not committed, and a re-run extracts it again. Rows count in commit order (parts by name, then row)."""
    latest = _decisive_rows(table)
    ok = pc.equal(latest["status"], OK)
    return latest if ok.null_count == 0 and pc.all(ok).as_py() else latest.filter(ok)  # no copy when all are "ok"


def skipped_rows(table: pa.Table) -> pa.Table:
    """Per sample skipped for good, its last "skipped" row (one no "ok" or "invalid" row came after)."""
    latest = _decisive_rows(table)
    return latest.filter(pc.equal(latest["status"], SKIPPED))


def ok_rows(run: RunDir | str, *, storage_options: dict | None = None) -> pa.Table:
    """One "ok" row per committed sample (see committed_rows), sorted by sample_id: columns sample_id, path,
    num_tokens, checksum, offset and bytes (offset null unless the sample lies in a shard: see sample_range). Raises FileNotFoundError when `run` has no manifest and ValueError when it has no
    committed sample, both saying what to pass instead.
    """
    run = as_run_dir(run, storage_options)
    if not run.exists(MANIFEST_DIR):
        raise FileNotFoundError(f"no manifest at {run.url_of(MANIFEST_DIR)}; pass the OUTPUT folder of an "
                                f"extraction run (it holds {RUN_JSON} and {MANIFEST_DIR}/)")
    table = read_manifest(run, columns=[*REQUIRED_COLUMNS, "checksum", "offset", "bytes"])
    total = table.num_rows
    table = committed_rows(table)
    if table.num_rows == 0:
        raise ValueError(f"manifest at {run.url_of(MANIFEST_DIR)} has {total} rows and none with status 'ok'; the "
                         "run has no usable samples (see its 'error' column for why they failed)")
    table = table.select(["sample_id", "path", "num_tokens", "checksum", "offset", "bytes"])
    if not _sorted_by_id(table):
        table = table.take(pc.sort_indices(table, sort_keys=[("sample_id", "ascending")]))
    return table.combine_chunks()


def sample_range(offset: int | None, length: int | None) -> tuple[int, int] | None:
    """The `byte_range` a reader takes for a manifest row's `offset` and `bytes`: None for a file of its own."""
    if offset is None:
        return None
    if length is None or offset < 0 or length < 0:
        raise RunFormatError(f"a manifest row places its sample at offset {offset} with length {length}: damaged; "
                             "re-run the same `hsx run` after `hsx verify` marks it")
    return int(offset), int(length)


def _sorted_by_id(table: pa.Table) -> bool:
    """Whether rows are in ascending sample_id order (as a compacted manifest is): one vectorized comparison."""
    ids = table["sample_id"]
    if len(ids) < 2 or ids.null_count:
        return len(ids) < 2
    return bool(pc.all(pc.less_equal(ids.slice(0, len(ids) - 1), ids.slice(1))).as_py())


def committed_ids(run: RunDir | str, *, storage_options: dict | None = None) -> set[str]:
    """Ids of committed samples (see committed_rows)."""
    table = read_manifest(run, columns=["sample_id", "status"], storage_options=storage_options)
    return set(committed_rows(table)["sample_id"].to_pylist())


SETTLED_COLUMNS = ("sample_id", "status", "retry")
"""What settled_rows reads of the manifest."""


def settled_ids(run: RunDir | str, *, retry_failed: bool = False, storage_options: dict | None = None) -> set[str]:
    """Ids a resume skips (see settled_rows)."""
    table = read_manifest(run, columns=list(SETTLED_COLUMNS), storage_options=storage_options)
    return set(settled_rows(table, retry_failed=retry_failed)["sample_id"].to_pylist())


def settled_rows(table: pa.Table, *, retry_failed: bool = False) -> pa.Table:
    """The sample ids a resume skips, one row each (column sample_id): committed samples and samples skipped for
    good (their last decisive row is "ok" or "skipped"), and — unless `retry_failed` — samples whose last row is a
    failure that repeats (retry false: a malformed record, no known field, over-length, ...). Other failures and
    samples hsx verify marked "invalid" are extracted again."""
    latest = _decisive_rows(table)
    settled = latest.filter(pc.is_in(latest["status"], pa.array([OK, SKIPPED]))).select(["sample_id"])
    if retry_failed or "retry" not in table.column_names:
        return settled
    final = pc.and_(pc.equal(table["status"], FAILED), pc.equal(pc.fill_null(table["retry"], True), False))
    candidates = pc.unique(table["sample_id"].filter(final))
    if not len(candidates):
        return settled
    mine = table.filter(pc.is_in(table["sample_id"], value_set=candidates))  # every row of those samples
    mine = mine.append_column("_row", pa.array(np.arange(mine.num_rows, dtype=np.int64)))
    last = mine.take(mine.group_by("sample_id", use_threads=False).aggregate([("_row", "max")])["_row_max"])
    repeats = last.filter(pc.and_(pc.equal(last["status"], FAILED), pc.equal(pc.fill_null(last["retry"], True),
                                                                                False)))
    both = pa.concat_tables([settled, repeats.select(["sample_id"])])
    return both.group_by("sample_id", use_threads=False).aggregate([])  # a sample ok before its repeat: once
