"""Manifest compaction (issue 26): the parts of many commits merged into a few large parts sorted by sample id,
every row kept and each sample's rows in commit order — so every reader (committed samples, `hsx status`, the
training feed) reads the same run — switched to atomically: a reader in the middle never sees duplicates or gaps."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import threading

import pyarrow as pa
import pytest

from connectors.manifest import (
    committed_ids,
    committed_rows,
    compact_manifest,
    live_manifest_parts,
    ok_rows,
    read_manifest,
)
from connectors.manifest_writer import ManifestWriter, summarize
from connectors.run import RunDir, RunFormatError
from tests.jobs.test_manifest import _rows


def history(out: RunDir, seed: int = 0, attempts: int = 6, samples: int = 60) -> None:
    """Several attempts' parts: failures later retried, samples marked invalid by verify and re-extracted, a
    duplicate ok row (a broken exactly-once that status must keep reporting), samples that only ever failed."""
    rng = random.Random(seed)
    for a in range(attempts):
        w = ManifestWriter(out, f"2026-{a:02d}", flush_rows=7, flush_seconds=3600)
        for i in rng.sample(range(samples), samples // 2):
            status = rng.choice(["ok", "ok", "failed", "invalid"])
            w.add(_rows((f"s{i:03d}", status)))
            w.maybe_flush()
        w.flush()
    ManifestWriter(out, "2026-99").add(_rows(("s001", "ok"), ("s001", "ok")))  # not flushed: nothing
    w = ManifestWriter(out, "2026-98")
    w.add(_rows(("s002", "ok"), ("s002", "ok")))
    w.flush()


def as_sorted(table: pa.Table) -> list[tuple]:
    return sorted(tuple(r.values()) for r in table.to_pylist())


def test_compaction_keeps_every_row_and_every_readers_answer(tmp_path):
    out = RunDir(str(tmp_path))
    history(out)
    before_parts = live_manifest_parts(out)
    assert len(before_parts) > 20
    before = read_manifest(out)
    answers = (as_sorted(committed_rows(before)), committed_ids(out), ok_rows(out).to_pylist(), summarize(out))
    done = compact_manifest(out, rows_per_part=50)
    assert (done.parts_before, done.rows) == (len(before_parts), before.num_rows)
    after_parts = live_manifest_parts(out)
    assert len(after_parts) == done.parts_after == -(-before.num_rows // 50)
    assert sorted(os.listdir(tmp_path / "manifest")) == sorted([*after_parts, *(n for n in os.listdir(
        tmp_path / "manifest") if n.endswith(".json"))])  # the superseded parts are gone
    after = read_manifest(out)
    assert as_sorted(after) == as_sorted(before)  # every row, attempt and commit time included
    ids = after["sample_id"].to_pylist()
    assert ids == sorted(ids)  # sorted by sample id across the parts
    summary = summarize(out)
    assert summary.duplicate_ok_rows == answers[3].duplicate_ok_rows > 0  # still reported
    assert dataclasses.replace(summary, parts=0) == dataclasses.replace(answers[3], parts=0)
    assert (as_sorted(committed_rows(after)), committed_ids(out), ok_rows(out).to_pylist()) == answers[:3]


def test_commits_after_a_compaction_count_after_it_and_compacting_again_merges_them(tmp_path):
    out = RunDir(str(tmp_path))
    history(out)
    compact_manifest(out)
    w = ManifestWriter(out, "2027-00")  # a later attempt: verify marks a committed sample invalid, another succeeds
    first_ok = sorted(committed_ids(out))[0]
    w.add(_rows((first_ok, "invalid"), ("s999", "ok")))
    w.flush()
    ids = committed_ids(out)
    assert first_ok not in ids and "s999" in ids
    rows = read_manifest(out).num_rows
    compact_manifest(out)
    assert len(live_manifest_parts(out)) == 1 and read_manifest(out).num_rows == rows
    assert committed_ids(out) == ids
    assert [n for n in os.listdir(tmp_path / "manifest") if n.endswith(".json")] == \
        [n for n in os.listdir(tmp_path / "manifest") if n.startswith("_compaction-")]
    assert len([n for n in os.listdir(tmp_path / "manifest") if n.endswith(".json")]) == 1  # older records removed


def test_a_reader_during_compactions_never_sees_duplicates_or_gaps(tmp_path):
    out = RunDir(str(tmp_path))
    history(out, attempts=4)
    expected = as_sorted(read_manifest(out))
    stop = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def reader() -> None:
        local = RunDir(str(tmp_path))
        while not stop.is_set():
            try:
                got = read_manifest(local)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return
            seen.append(got.num_rows)
            if as_sorted(got) != expected:
                errors.append(AssertionError(f"a read saw {got.num_rows} rows, not the {len(expected)} committed"))
                return

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(25):  # each compaction supersedes the last one's parts (several, small: many switch points)
            compact_manifest(out, rows_per_part=7 + i, min_parts=1)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert len(seen) >= 5 and set(seen) == {len(expected)}


def test_a_compaction_that_died_before_its_record_is_not_read_and_is_cleaned_up(tmp_path):
    out = RunDir(str(tmp_path))
    history(out, attempts=2)
    expected = as_sorted(read_manifest(out))
    parts = live_manifest_parts(out)
    # what a compaction killed after writing its parts and before its record leaves behind
    leftover = "part-2026-50-deadbeef-c000000-xxh3_64_0000000000000000.parquet"
    (tmp_path / "manifest" / leftover).write_bytes((tmp_path / "manifest" / parts[0]).read_bytes())
    assert leftover not in live_manifest_parts(out) and as_sorted(read_manifest(out)) == expected
    compact_manifest(out)
    assert leftover not in os.listdir(tmp_path / "manifest") and as_sorted(read_manifest(out)) == expected


def test_a_damaged_compaction_record_is_refused_naming_the_fix(tmp_path):
    out = RunDir(str(tmp_path))
    history(out, attempts=2)
    compact_manifest(out)
    record = next(n for n in os.listdir(tmp_path / "manifest") if n.endswith(".json"))
    doc = json.loads((tmp_path / "manifest" / record).read_text())
    assert set(doc) == {"parts", "supersedes", "rows"}
    (tmp_path / "manifest" / record).write_text('{"parts": ["x"')
    with pytest.raises(RunFormatError, match=rf"compaction record .*{record} is unreadable .* run `hsx compact`"):
        read_manifest(out)


def test_nothing_to_merge_below_two_parts(tmp_path):
    out = RunDir(str(tmp_path))
    w = ManifestWriter(out, "A")
    w.add(_rows(("a", "ok")))
    w.flush()
    assert compact_manifest(out).rows == -1 and len(os.listdir(tmp_path / "manifest")) == 1
