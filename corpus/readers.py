"""Corpus files -> records, streaming, with every bad line turned into a failed record instead of an exception.

    expand_corpus(patterns, storage_options) -> [CorpusFile]      globs and folders, local or any fsspec URL
    read_records(file, id_field, ...) -> Iterator[[Record]]       blocks of records, in file order
    count_records(file, storage_options) -> int                   cheap count for progress totals
    read_stage(files_batch, ...) -> Iterator[pa.Table]            the Ray Data read stage (RECORD_SCHEMA blocks)
    READERS                                                       format -> (reader, counter, what a position is)

Formats, one module each: JSONL (corpus/jsonl.py: .jsonl, .ndjson, .json; .gz/.bz2/.xz/.zst compressed too)
and Parquet (corpus/parquet.py, read in row batches). What a record is and the text rules every reader applies
(sample ids, storable errors): corpus/records.py.

A record's sample id is its `id_field` value when present, else `<file stem>-<hash of the file URL>-<line>` (line
1-based in JSONL, row 0-based in Parquet) — stable across re-runs over the same files. The record itself travels on
as JSON text (`payload`); what it holds (prompt, chat, tokens) is decided at tokenization.

Hostile input stays per record: every line or row becomes exactly one Record, whatever it holds, and no record's
failure takes its block or the rest of its file with it; a read that breaks off ends its file with one failed record.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Callable, Iterator
from typing import NamedTuple

import fsspec
import pyarrow as pa

from corpus.jsonl import MAX_RECORD_BYTES, count_lines, read_jsonl
from corpus.parquet import count_rows, read_parquet
from corpus.records import (
    COMPRESSION_SUFFIXES,
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    RECORD_SCHEMA,
    CorpusFile,
    Record,
    invalid_unicode,
    records_table,
    short_repr,
    storable_text,
)
from corpus.regenerated import REGEN_JSON, count_committed, read_following, read_regenerated
from corpus.sample_registry import SKIP, claim_block

__all__ = ["BLOCK_BYTES", "MAX_RECORD_BYTES", "READERS", "RECORD_SCHEMA", "CorpusFile", "Record", "count_records",
           "expand_corpus", "file_format", "invalid_unicode", "read_records", "read_stage", "short_repr",
           "storable_text"]

logger = logging.getLogger(__name__)

BLOCK_BYTES = 64 << 20
"""A block of records closes once its payloads hold this many characters, however few records it has."""
_GLOB_CHARS = set("*?[")


class Reader(NamedTuple):
    read: Callable[..., Iterator[tuple[int, Record]]]
    """(file, id_field, storage_options, max_record_bytes) -> (position, Record) in file order."""
    count: Callable[[CorpusFile, dict | None], int]
    first: int
    """The first position: lines count from 1, rows from 0."""
    unit: str
    mark: str
    """How a source names a position: URL:LINE or URL#ROW."""


READERS = {
    "jsonl": Reader(read_jsonl, count_lines, 1, "line", ":"),
    "parquet": Reader(lambda file, id_field, storage_options, _max: read_parquet(file, id_field, storage_options),
                      count_rows, 0, "row", "#"),
    # a folder of `hsx regenerate`: its committed records; "-follow" while it is being written (yields None when
    # it has read all there is for now)
    "regenerated": Reader(read_regenerated, count_committed, 0, "record", "#"),
    "regenerated-follow": Reader(read_following, count_committed, 0, "record", "#"),
}


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
            candidates = sorted(fs.find(path))
            # folders of hsx regenerate (a regenerate.json): read through their manifests, their parts never listed
            regenerated = [posixpath.dirname(p) for p in candidates if posixpath.basename(p) == REGEN_JSON]
            for root in regenerated:
                url = os.path.abspath(root) if local else fs.unstrip_protocol(root)
                found.setdefault(url, CorpusFile(url, "regenerated"))
            candidates = [p for p in candidates if file_format(p) is not None
                          and not any(p.startswith(root + "/") for root in regenerated)]
            if regenerated and not candidates:
                continue
        elif fs.exists(path):
            candidates = [path]
        else:
            raise ValueError(f"--corpus {pattern!r}: no such file or folder")
        matched = 0
        for p in candidates:
            url = os.path.abspath(p) if local else fs.unstrip_protocol(p)
            if invalid_unicode(url):  # a local name of non-UTF-8 bytes (Python keeps them as surrogates)
                raise ValueError(f"--corpus {pattern!r}: the file name {url!r} is not valid UTF-8; rename it (each "
                                 "record's source, file name and line, is stored as text in the manifest)")
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


def read_records(file: CorpusFile, id_field: str = "id", storage_options: dict | None = None,
                 block_rows: int = 256, block_bytes: int = BLOCK_BYTES,
                 max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[list[Record]]:
    """Yield blocks of at most `block_rows` records (fewer once they hold `block_bytes` of payload); unreadable
    input becomes failed records, never an exception.

    A read that breaks off (truncated archive, lost connection after retries) ends the file with one failed record
    for the first line it could not read, after every line it could.
    """
    block: list[Record] = []
    size = 0
    reader = READERS[file.format]
    last = reader.first - 1  # position read last
    try:
        for position, record in reader.read(file, id_field, storage_options, max_record_bytes):
            if record is None:  # a following reader has read all there is for now: hand the block on
                if block:
                    yield block
                    block, size = [], 0
                continue
            last = position
            block.append(record)
            size += len(record.payload or "")
            if len(block) >= block_rows or size >= block_bytes:
                yield block
                block, size = [], 0
    except Exception as e:  # noqa: BLE001 - any read failure becomes a failed record of this file
        nxt = last + 1
        logger.warning("reading %s stopped after position %d: %s", file.url, last, e)
        source = f"{file.url}{reader.mark}{nxt}"
        block.append(Record(f"{file.tag}-{nxt}", source,
                            error=f"{source}: reading stopped at {reader.unit} {nxt}: {type(e).__name__}: {e}"))
    if block:
        yield block


def count_records(file: CorpusFile, storage_options: dict | None = None) -> int:
    """Records in a file, for progress totals: Parquet from its footer, JSONL by counting lines (an upper bound)."""
    return READERS[file.format].count(file, storage_options)


def read_stage(files: pa.Table, *, id_field: str, storage_options: dict, registry) -> Iterator[pa.Table]:
    """Ray Data read stage: corpus files -> record blocks, minus committed ids; duplicate ids become failed records.

    `registry` is the SampleRegistry shard actors (see registry.py); one claim call per shard and block.
    """
    for url, fmt in zip(files["url"].to_pylist(), files["format"].to_pylist()):
        for records in read_records(CorpusFile(url, fmt), id_field, storage_options):
            verdicts = claim_block(registry, [r.sample_id for r in records], [r.source for r in records])
            keep = [r if v is None else Record(r.sample_id, r.source, error=v)
                    for r, v in zip(records, verdicts) if v != SKIP]
            if keep:
                yield records_table(keep)
