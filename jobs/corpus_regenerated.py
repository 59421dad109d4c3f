"""A regenerated corpus (`hsx regenerate`'s OUTPUT, jobs/regenerate.py) read as corpus records: its committed records
only, each through its manifest row — the byte range of its line in a data part, the line's checksum checked. Parts
no row commits (a driver died between a part and its commit) are never read. A record over `max_record_bytes` (every
corpus's record limit, jobs.corpus_jsonl.MAX_RECORD_BYTES) fails alone and is never read; a data part larger than
PART_READ_BYTES is read a record's byte range at a time.

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

import time
from collections.abc import Iterator

from connectors.format import data_checksum
from connectors.lease import live_writer
from connectors.manifest import OK, live_manifest_parts, read_manifest_part, row_path_problem
from connectors.run import RunDir
from jobs.records import CorpusFile, Record

REGEN_JSON = "regenerate.json"
"""What makes a folder a regenerated corpus (its settings: jobs/regenerate.py)."""
FINISHED = "finished.json"
"""Written when a regeneration attempt ends (its counts, or why it stopped): a following reader stops once it has read
every part committed before it."""
POLL_S = 1.0
PART_READ_BYTES = 64 << 20
"""A data part up to this size is read whole (once for all its records); a larger one a record at a time."""
_COLUMNS = ["sample_id", "status", "path", "offset", "bytes", "checksum"]


class RegenerationStopped(RuntimeError):
    """The regeneration a following reader reads ended without finishing (no finished.json, no live writer)."""


def _records(run: RunDir, url: str, part: str, max_record_bytes: int) -> Iterator[Record]:
    """The committed records of one manifest part, their data parts read once each (or by range, when large)."""
    import pyarrow.compute as pc

    rows = read_manifest_part(run, part, _COLUMNS)
    rows = rows.filter(pc.equal(rows["status"], OK)).to_pylist()
    cache: dict[str, bytes | None] = {}
    for row in rows:
        path, sid = row["path"], row["sample_id"]
        source = f"{url}/{path}#{row['offset']}"
        try:
            problem = row_path_problem(path)
            if problem is None and not path.startswith("data/part-"):
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
    from connectors.manifest import committed_rows, read_manifest

    run = RunDir(file.url, storage_options)
    return committed_rows(read_manifest(run, columns=["sample_id", "status"])).num_rows
