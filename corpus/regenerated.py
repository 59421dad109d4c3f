"""The regenerated corpus (`hsx regenerate`'s OUTPUT): its one owner. The regeneration (regeneration/regenerate.py) writes
it through this module, and `hsx run --corpus OUTPUT` (corpus/readers.py), `hsx status` and the tests read it through it.

    OUTPUT/regenerate.json                 what produced it (model, sampling, reasoning; the corpus files); a re-run
                                           checks it
    OUTPUT/data/part-<attempt>-<seq>.jsonl the regenerated records of one commit, one JSON object a line
    OUTPUT/manifest/part-*.parquet         connectors.manifest's parts: per input record one row, "ok" (path = its
                                           part, offset/bytes = its line, checksum = the line's xxh3) or "failed"
                                           (the error; retry false when it fails the same way every time)
    OUTPUT/finished.json                   written when an attempt ends (its counts, or why it stopped)

A part's lines are written (atomically) before the manifest part that commits them: a record counts only with its
"ok" row, and a part without one (the driver died in between) is an orphan that readers never see and the next run
removes.

The writer's side (the regeneration, in call order):
    read_spec(run) -> dict | None       regenerate.json, or None; RunFormatError when this hsx cannot read it
    write_spec(run, settings, corpus)   a new regeneration's regenerate.json
    forget_finished(run)                an attempt starts: the last one's finished.json goes
    remove_orphans(run) -> int          data parts no manifest row points at (an attempt died in between): removed
    PartWriter(run, attempt)            .add(settled) buffers one input record's outcome; .due(rows, seconds);
                                        .flush() puts one data part, then the manifest part that commits it
    write_finished(run, attempt, ok, failed, stopped)

The reader's side: committed records only, each through its manifest row — the byte range of its line in a data
part, the line's checksum checked. A record over `max_record_bytes` (every corpus's record limit,
corpus.jsonl.MAX_RECORD_BYTES) fails alone and is never read; a data part larger than PART_READ_BYTES is read a
record's byte range at a time.
    read_regenerated(file, id_field, storage_options, max_record_bytes)
                                        (position, Record) in commit order; the sample id is the manifest row's
    read_following(...)                 the same while the corpus is still being written (hsx run --regenerate-with):
                                        reads each manifest part as it appears, until the regeneration's attempt
                                        ends (its finished.json) and every part committed before that is read; yields
                                        (position, None) when it has read everything there is for now. A
                                        regeneration that stops without finished.json (its writer lease gone: it
                                        died, its storage failed) ends the read with RegenerationStopped
    count_committed(file, storage_options)
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from connectors.format import data_checksum
from connectors.lease import live_writer
from connectors.manifest import (
    FAILED,
    OK,
    RESULT_SCHEMA,
    committed_rows,
    live_manifest_parts,
    read_manifest,
    read_manifest_part,
    referenced_paths,
    row_path_problem,
)
from connectors.manifest_writer import ManifestWriter
from connectors.run import RunDir, RunFormatError
from connectors.storage import retrying
from corpus.records import CorpusFile, Record

REGEN_JSON = "regenerate.json"
"""What makes a folder a regenerated corpus (its settings: regeneration/config.py)."""
REGEN_FORMAT = "hsx.regenerated"
REGEN_VERSION = "1"
DATA_PREFIX = "data/part-"
FINISHED = "finished.json"
"""Written when a regeneration attempt ends (its counts, or why it stopped): a following reader stops once it has read
every part committed before it."""
POLL_S = 1.0
PART_READ_BYTES = 64 << 20
"""A data part up to this size is read whole (once for all its records); a larger one a record at a time."""
_COLUMNS = ["sample_id", "status", "path", "offset", "bytes", "checksum"]


# -- regenerate.json and finished.json ----------------------------------------------------------------------------


def read_spec(run: RunDir) -> dict[str, Any] | None:
    """regenerate.json, or None; RunFormatError when it is not one this hsx reads."""
    if not run.exists(REGEN_JSON):
        return None
    try:
        doc = json.loads(run.read_bytes(REGEN_JSON))
    except ValueError as e:
        raise RunFormatError(f"{run.url_of(REGEN_JSON)} is not JSON ({e}); the folder was damaged") from None
    if not isinstance(doc, dict) or doc.get("format") != REGEN_FORMAT:
        raise RunFormatError(f"{run.url_of(REGEN_JSON)} is not a regenerated corpus's (format "
                             f"{doc.get('format') if isinstance(doc, dict) else None!r})")
    if doc.get("version") != REGEN_VERSION:
        raise RunFormatError(f"{run.url_of(REGEN_JSON)} has version {doc.get('version')!r}; this hsx reads "
                             f"{REGEN_VERSION}: upgrade hsx")
    return doc


def write_spec(run: RunDir, settings: dict[str, Any], corpus: list[str]) -> None:
    """A new regeneration's regenerate.json: its settings (RegenerateConfig.spec) and corpus files."""
    run.put(REGEN_JSON, json.dumps({"format": REGEN_FORMAT, "version": REGEN_VERSION, "settings": settings,
                                    "corpus": corpus, "created_at": time.time()}, indent=2).encode())


def forget_finished(run: RunDir) -> None:
    """An attempt starts: the last attempt's finished.json goes (a following reader waits for this one's)."""
    with contextlib.suppress(FileNotFoundError):
        run.fs.rm(run.path(FINISHED))


def write_finished(run: RunDir, attempt: str, ok: int, failed: int, stopped: str | None) -> None:
    """An attempt ends: its counts, or why it stopped."""
    run.put(FINISHED, json.dumps({"attempt": attempt, "ok": ok, "failed": failed, "stopped": stopped}).encode())


# -- the writer ---------------------------------------------------------------------------------------------------


class Settled(Protocol):
    """What the writer commits of one input record (regeneration.regenerator.Outcome is one)."""

    sample_id: str
    source: str
    record: dict[str, Any] | None
    """The regenerated record (None: it failed)."""
    error: str | None
    retry: bool
    """False when it fails the same way every time (a re-run skips it unless --retry-failed)."""
    prompt_tokens: int
    tokens: int


class PartWriter:
    """Buffers outcomes; each flush puts one data part (the ok records' lines) and then the manifest part that
    commits them."""

    def __init__(self, run: RunDir, attempt: str, retry_s: float = 120.0) -> None:
        self.run = run
        self.attempt = attempt
        self.retry_s = retry_s
        self.manifest = ManifestWriter(run, attempt, flush_rows=1 << 62, retry_s=retry_s)
        self.lines: list[bytes] = []
        self.rows: list[dict[str, Any]] = []
        self.seq = 0
        self.last = time.monotonic()
        self._lock = threading.Lock()  # a flush cancelled while in its thread may still run: the next one waits

    def add(self, o: Settled) -> None:
        if o.record is None:
            self.rows.append({"sample_id": o.sample_id, "status": FAILED, "error": o.error, "source": o.source,
                              "retry": o.retry})
            return
        line = json.dumps(o.record, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n"
        self.rows.append({"sample_id": o.sample_id, "status": OK, "source": o.source, "bytes": len(line),
                          "num_tokens": o.tokens or None, "num_prompt_tokens": o.prompt_tokens or None,
                          "checksum": data_checksum([line]), "truncated": False, "_line": len(self.lines)})
        self.lines.append(line)

    def due(self, rows: int, seconds: float) -> bool:
        return len(self.rows) >= rows or (bool(self.rows) and time.monotonic() - self.last >= seconds)

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        self.last = time.monotonic()
        if not self.rows:
            self.manifest.flush()  # a part whose put raised earlier
            return
        if self.lines:
            name = f"{DATA_PREFIX}{self.attempt}-{self.seq:06d}.jsonl"
            offsets = [0]
            for line in self.lines:
                offsets.append(offsets[-1] + len(line))
            for row in self.rows:
                if "_line" in row:
                    row.update(path=name, offset=offsets[row.pop("_line")])
            retrying("data part", self.run.url_of(name), 1, 0.2, self.retry_s)(self.run.put, name, b"".join(self.lines))
        self.seq += 1
        self.manifest.add(pa.Table.from_pylist(self.rows, schema=RESULT_SCHEMA))  # every row, whatever its keys
        self.manifest.flush()
        self.lines, self.rows = [], []


def remove_orphans(run: RunDir) -> int:
    """Data parts no manifest row points at (a driver died between a part and its commit): removed."""
    names = [f"data/{n}" for n in run.list("data") if f"data/{n}".startswith(DATA_PREFIX)]
    if not names:
        return 0
    live = referenced_paths(run, DATA_PREFIX)
    gone = 0
    for name in names:
        if name not in live:
            with contextlib.suppress(FileNotFoundError):
                run.fs.rm(run.path(name))
                gone += 1
    return gone


# -- the reader ---------------------------------------------------------------------------------------------------


class RegenerationStopped(RuntimeError):
    """The regeneration a following reader reads ended without finishing (no finished.json, no live writer)."""


def _records(run: RunDir, url: str, part: str, max_record_bytes: int) -> Iterator[Record]:
    """The committed records of one manifest part, their data parts read once each (or by range, when large)."""
    rows = read_manifest_part(run, part, _COLUMNS)
    rows = rows.filter(pc.equal(rows["status"], OK)).to_pylist()
    cache: dict[str, bytes | None] = {}
    for row in rows:
        path, sid = row["path"], row["sample_id"]
        source = f"{url}/{path}#{row['offset']}"
        try:
            problem = row_path_problem(path)
            if problem is None and not path.startswith(DATA_PREFIX):
                problem = f"the manifest row's path {path!r} is not a data part of a regenerated corpus (data/part-*)"
            if problem:  # a damaged or planted manifest: never a file outside the corpus
                raise ValueError(problem)
            if not 0 <= row["bytes"] <= max_record_bytes:  # never held in memory, as every corpus's long lines
                raise ValueError(f"the record is {row['bytes']} bytes long, over the {max_record_bytes}-byte record "
                                 "limit; regenerate it with a lower --max-tokens or --max-answer-bytes")
            if path not in cache:
                cache.clear()  # one data part at a time: a commit's rows point into one
                whole = run.fs.size(run.path(path)) <= PART_READ_BYTES
                cache[path] = run.read_bytes(path) if whole else None
            start, end = row["offset"], row["offset"] + row["bytes"]
            data = cache[path]
            line = data[start:end] if data is not None else run.fs.cat_file(run.path(path), start=start, end=end)
            if len(line) != row["bytes"] or data_checksum([line]) != row["checksum"]:
                raise ValueError(f"the record's bytes do not match its manifest row (checksum {row['checksum']}): "
                                 f"{url}/{path} was damaged; delete {url} and regenerate, or re-run hsx regenerate "
                                 "after removing that part's manifest rows")
            yield Record(sid, source, payload=line.decode("utf-8").rstrip("\n"))
        except (OSError, ValueError) as e:  # this record fails; the others are read
            yield Record(sid, source, error=f"{source}: {e}")


def read_regenerated(file: CorpusFile, id_field: str, storage_options: dict | None,
                     max_record_bytes: int) -> Iterator[tuple[int, Record]]:
    run = RunDir(file.url, storage_options)
    position = 0
    for part in live_manifest_parts(run):
        for record in _records(run, file.url, part, max_record_bytes):
            yield position, record
            position += 1


def read_following(file: CorpusFile, id_field: str, storage_options: dict | None,
                   max_record_bytes: int) -> Iterator[tuple[int, Record | None]]:
    run = RunDir(file.url, storage_options)
    read: set[str] = set()
    position = 0
    while True:
        writing = live_writer(run)  # before finished.json: a writer writes it before it gives its lease back
        finished = run.exists(FINISHED)  # before the listing: every part committed before the end is in it
        new = [p for p in live_manifest_parts(run) if p not in read]
        for part in new:
            read.add(part)
            for record in _records(run, file.url, part, max_record_bytes):
                yield position, record
                position += 1
        if finished:
            return
        if writing is None:
            raise RegenerationStopped(
                f"the regeneration writing {file.url} stopped before it finished (no {FINISHED}, and no live writer "
                "lease: it died, or its storage failed); every record it committed was read. Re-run the same command "
                "to finish it")
        yield position, None  # what there is, now: the reader hands its block on
        time.sleep(POLL_S)


def count_committed(file: CorpusFile, storage_options: dict | None = None) -> int:
    run = RunDir(file.url, storage_options)
    return committed_rows(read_manifest(run, columns=["sample_id", "status"])).num_rows
