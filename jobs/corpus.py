"""Corpus files -> records, streaming, with every bad line turned into a failed record instead of an exception.

    expand_corpus(patterns, storage_options) -> [CorpusFile]      globs and folders, local or any fsspec URL
    read_records(file, id_field, ...) -> Iterator[[Record]]       blocks of records, in file order
    count_records(file, storage_options) -> int                   cheap count for progress totals
    read_stage(files_batch, ...) -> Iterator[pa.Table]            the Ray Data read stage (RECORD_SCHEMA blocks)

Formats: JSONL (.jsonl, .ndjson, .json; .gz/.bz2/.xz/.zst compressed too; a .json file holding one JSON array is
read whole) and Parquet (.parquet, .pq), read in row batches.

A record's sample id is its `id_field` value when present, else `<file stem>-<hash of the file URL>-<line>` (line
1-based in JSONL, row 0-based in Parquet) — stable across re-runs over the same files. The record itself travels on
as JSON text (`payload`); what it holds (prompt, chat, tokens) is decided at tokenization.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import pyarrow as pa

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
_GLOB_CHARS = set("*?[")
RECORD_SCHEMA = pa.schema([("sample_id", pa.string()), ("source", pa.string()), ("payload", pa.string()),
                           ("error", pa.string())])


@dataclass(frozen=True)
class CorpusFile:
    url: str
    """Absolute local path or full fsspec URL."""
    format: str
    """"jsonl" or "parquet"."""

    @property
    def tag(self) -> str:
        """Prefix of derived sample ids: readable stem plus a hash of the full URL (same stem, other folder)."""
        name = self.url.rstrip("/").rsplit("/", 1)[-1]
        for suffix in COMPRESSION_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES:
            name = name.removesuffix(suffix)
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:60] or "corpus"
        return f"{stem}-{hashlib.sha1(self.url.encode()).hexdigest()[:8]}"


@dataclass
class Record:
    sample_id: str
    source: str
    """Where it came from: "URL:LINE" (JSONL, 1-based) or "URL#ROW" (Parquet, 0-based)."""
    payload: str | None = None
    """The record as JSON text; None when the record could not be read."""
    error: str | None = None
    """Why the record cannot be used (malformed JSON, bad bytes, ...); the record becomes a failed row."""


def file_format(url: str) -> str | None:
    name = url.lower()
    for suffix in COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def expand_corpus(patterns: tuple[str, ...] | list[str], storage_options: dict | None = None) -> list[CorpusFile]:
    """Resolve corpus arguments (files, folders, globs) to files, sorted and de-duplicated.

    Raises ValueError naming the argument when it matches nothing or names a file of an unsupported type.
    """
    if not patterns:
        raise ValueError("--corpus is required: pass JSONL or Parquet files, folders or globs")
    found: dict[str, CorpusFile] = {}
    for pattern in patterns:
        fs, path = fsspec.core.url_to_fs(pattern, **(storage_options or {}))
        local = "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol)
        if _GLOB_CHARS & set(path):
            candidates = sorted(p for p in fs.glob(path) if fs.isfile(p))
        elif fs.isdir(path):
            candidates = sorted(p for p in fs.find(path) if file_format(p) is not None)
        elif fs.exists(path):
            candidates = [path]
        else:
            raise ValueError(f"--corpus {pattern!r}: no such file or folder")
        matched = 0
        for p in candidates:
            url = os.path.abspath(p) if local else fs.unstrip_protocol(p)
            fmt = file_format(url)
            if fmt is None:
                if _GLOB_CHARS & set(path) or fs.isdir(path):
                    continue  # globs and folders pick the files hsx can read
                raise ValueError(f"--corpus {pattern!r}: cannot read {url!r}; use .jsonl/.json (optionally .gz) or "
                                 ".parquet files")
            found.setdefault(url, CorpusFile(url, fmt))
            matched += 1
        if matched == 0:
            raise ValueError(f"--corpus {pattern!r} matches no .jsonl/.json/.parquet files")
    return sorted(found.values(), key=lambda f: f.url)


def _record_id(obj: dict, id_field: str, derived: str) -> tuple[str, str | None]:
    """(sample_id, error): the record's own id when it has a usable one, else the derived id."""
    if id_field not in obj or obj[id_field] is None:
        return derived, None
    value = obj[id_field]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return derived, f"field {id_field!r} must be a string or integer sample id, got {type(value).__name__}"
    value = str(value)
    if not value.strip():
        return derived, f"field {id_field!r} is an empty sample id"
    return value, None


def _from_obj(obj, id_field: str, derived: str, source: str, payload: str | None = None) -> Record:
    if not isinstance(obj, dict):
        return Record(derived, source, error=f"{source}: a record must be a JSON object, got {type(obj).__name__}")
    sample_id, err = _record_id(obj, id_field, derived)
    if err:
        return Record(sample_id, source, error=f"{source}: {err}")
    if payload is None:
        try:
            payload = json.dumps(obj, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            return Record(sample_id, source, error=f"{source}: record cannot be represented as JSON ({e})")
    return Record(sample_id, source, payload=payload)


def read_records(file: CorpusFile, id_field: str = "id", storage_options: dict | None = None,
                 block_rows: int = 256) -> Iterator[list[Record]]:
    """Yield blocks of at most `block_rows` records; unreadable input becomes failed records, never an exception.

    A read that breaks off (truncated archive, lost connection after retries) ends the file with one failed record
    for the first line it could not read.
    """
    block: list[Record] = []
    reader = _read_parquet if file.format == "parquet" else _read_jsonl
    last = -1 if file.format == "parquet" else 0  # position read last (rows from 0, lines from 1)
    try:
        for position, record in reader(file, id_field, storage_options):
            last = position
            block.append(record)
            if len(block) >= block_rows:
                yield block
                block = []
    except Exception as e:  # noqa: BLE001 - any read failure becomes a failed record of this file
        nxt = last + 1
        logger.warning("reading %s stopped after position %d: %s", file.url, last, e)
        sep = "#" if file.format == "parquet" else ":"
        block.append(Record(f"{file.tag}-{nxt}", f"{file.url}{sep}{nxt}",
                            error=f"{file.url}: reading stopped at {'row' if sep == '#' else 'line'} {nxt}: "
                                  f"{type(e).__name__}: {e}"))
    if block:
        yield block


def _read_jsonl(file: CorpusFile, id_field: str, storage_options: dict | None) -> Iterator[tuple[int, Record]]:
    with fsspec.open(file.url, "rb", compression="infer", **(storage_options or {})) as f:
        head = f.read(1 << 16)
        if file.url.lower().removesuffix(".gz").endswith(".json") and head.lstrip()[:1] == b"[":
            yield from _read_json_array(file, id_field, head + f.read())
            return
        lineno = 0
        pending = head
        while True:
            nl = pending.find(b"\n")
            if nl < 0:
                more = f.read(1 << 20)
                if more:
                    pending += more
                    continue
                if not pending:
                    return
                line, pending = pending, b""
            else:
                line, pending = pending[:nl], pending[nl + 1:]
            lineno += 1
            record = _parse_line(file, id_field, lineno, line)
            if record is not None:
                yield lineno, record


def _parse_line(file: CorpusFile, id_field: str, lineno: int, raw: bytes) -> Record | None:
    derived, source = f"{file.tag}-{lineno}", f"{file.url}:{lineno}"
    raw = raw.rstrip(b"\r")
    if not raw.strip():
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Record(derived, source, error=f"{source}: line is not valid UTF-8 (bad byte 0x{raw[e.start]:02x} at "
                                             f"offset {e.start})")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Record(derived, source, error=f"{source}: malformed JSON at column {e.colno}: {e.msg}")
    return _from_obj(obj, id_field, derived, source, payload=text)


def _read_json_array(file: CorpusFile, id_field: str, data: bytes) -> Iterator[tuple[int, Record]]:
    try:
        items = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        yield 1, Record(f"{file.tag}-1", f"{file.url}:1", error=f"{file.url}: not a valid JSON array file: {e}")
        return
    for i, obj in enumerate(items):
        yield i + 1, _from_obj(obj, id_field, f"{file.tag}-{i + 1}", f"{file.url}:{i + 1}")


def _read_parquet(file: CorpusFile, id_field: str, storage_options: dict | None) -> Iterator[tuple[int, Record]]:
    import pyarrow.parquet as pq

    with fsspec.open(file.url, "rb", **(storage_options or {})) as f:
        row = -1
        for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
            for obj in batch.to_pylist():
                row += 1
                yield row, _from_obj(obj, id_field, f"{file.tag}-{row}", f"{file.url}#{row}")


def count_records(file: CorpusFile, storage_options: dict | None = None) -> int:
    """Records in a file, for progress totals: Parquet from its footer, JSONL by counting lines (an upper bound)."""
    if file.format == "parquet":
        import pyarrow.parquet as pq

        with fsspec.open(file.url, "rb", **(storage_options or {})) as f:
            return pq.ParquetFile(f).metadata.num_rows
    n, last = 0, b"\n"
    with fsspec.open(file.url, "rb", compression="infer", **(storage_options or {})) as f:
        while chunk := f.read(1 << 22):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def read_stage(files: pa.Table, *, id_field: str, storage_options: dict, registry) -> Iterator[pa.Table]:
    """Ray Data read stage: corpus files -> record blocks, minus committed ids; duplicate ids become failed records.

    `registry` is the SampleRegistry actor (see registry.py); one claim call per block.
    """
    import ray

    from jobs.registry import SKIP

    for url, fmt in zip(files["url"].to_pylist(), files["format"].to_pylist()):
        for records in read_records(CorpusFile(url, fmt), id_field, storage_options):
            verdicts = ray.get(registry.claim.remote([r.sample_id for r in records], [r.source for r in records]))
            keep = [r if v is None else Record(r.sample_id, r.source, error=v)
                    for r, v in zip(records, verdicts) if v != SKIP]
            if keep:
                yield pa.Table.from_pydict({"sample_id": [r.sample_id for r in keep],
                                            "source": [r.source for r in keep],
                                            "payload": [r.payload for r in keep],
                                            "error": [r.error for r in keep]}, schema=RECORD_SCHEMA)
