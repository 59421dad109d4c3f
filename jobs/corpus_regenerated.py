"""A regenerated corpus (`hsx regenerate`'s OUTPUT, jobs/regenerate.py) read as corpus records: its committed records
only, each through its manifest row — the byte range of its line in a data part, the line's checksum checked. Parts
no row commits (a driver died between a part and its commit) are never read.

    read_regenerated(file, id_field, storage_options, max_record_bytes)
                                        (position, Record) in commit order; the sample id is the manifest row's
    read_following(...)                 the same while the corpus is still being written (hsx run --regenerate-with):
                                        reads each manifest part as it appears, until the regeneration's attempt
                                        ends (its finished.json) and every part committed before that is read; yields
                                        (position, None) when it has read everything there is for now
    count_committed(file, storage_options)
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from connectors.format import data_checksum
from connectors.run import OK, RunDir, live_manifest_parts, read_manifest_part, row_path_problem
from jobs.records import CorpusFile, Record

REGEN_JSON = "regenerate.json"
"""What makes a folder a regenerated corpus (its settings: jobs/regenerate.py)."""
FINISHED = "finished.json"
"""Written when a regeneration attempt ends (its counts, or why it stopped): a following reader stops once it has read
every part committed before it."""
POLL_S = 1.0
_COLUMNS = ["sample_id", "status", "path", "offset", "bytes", "checksum"]


def _records(run: RunDir, url: str, part: str) -> Iterator[Record]:
    """The committed records of one manifest part, their data parts read once each."""
    import pyarrow.compute as pc

    rows = read_manifest_part(run, part, _COLUMNS)
    rows = rows.filter(pc.equal(rows["status"], OK)).to_pylist()
    cache: dict[str, bytes] = {}
    for row in rows:
        path, sid = row["path"], row["sample_id"]
        source = f"{url}/{path}#{row['offset']}"
        try:
            problem = row_path_problem(path)
            if problem is None and not path.startswith("data/part-"):
                problem = f"the manifest row's path {path!r} is not a data part of a regenerated corpus (data/part-*)"
            if problem:  # a damaged or planted manifest: never a file outside the corpus
                raise ValueError(problem)
            if path not in cache:
                cache.clear()  # one data part at a time: a commit's rows point into one
                cache[path] = run.read_bytes(path)
            line = cache[path][row["offset"]:row["offset"] + row["bytes"]]
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
        for record in _records(run, file.url, part):
            yield position, record
            position += 1


def read_following(file: CorpusFile, id_field: str, storage_options: dict | None,
                   max_record_bytes: int) -> Iterator[tuple[int, Record | None]]:
    run = RunDir(file.url, storage_options)
    read: set[str] = set()
    position = 0
    while True:
        finished = run.exists(FINISHED)  # before the listing: every part committed before the end is in it
        new = [p for p in live_manifest_parts(run) if p not in read]
        for part in new:
            read.add(part)
            for record in _records(run, file.url, part):
                yield position, record
                position += 1
        if finished:
            return
        yield position, None  # what there is, now: the reader hands its block on
        time.sleep(POLL_S)


def count_committed(file: CorpusFile, storage_options: dict | None = None) -> int:
    from connectors.run import committed_rows, read_manifest

    run = RunDir(file.url, storage_options)
    return committed_rows(read_manifest(run, columns=["sample_id", "status"])).num_rows
