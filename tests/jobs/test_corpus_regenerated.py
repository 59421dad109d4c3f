"""A folder of `hsx regenerate` read as a corpus: committed records only (a part no manifest row commits — a driver
killed between the two writes — is never read), each line checked against its row's checksum, the manifest's sample
ids; a folder holding one is read through its manifest, never by listing its parts; the following reader (hsx run
--regenerate-with) reads parts as they are committed and stops at the attempt's end. Written by the real PartWriter."""

from __future__ import annotations

import json
import threading
import time

from connectors.run import RunDir
from corpus.readers import expand_corpus, read_records
from corpus.records import CorpusFile
from corpus.regenerated import FINISHED, REGEN_JSON, PartWriter, remove_orphans
from regeneration.regenerator import Outcome


def outcome(i: int, ok: bool = True) -> Outcome:
    if not ok:
        return Outcome(f"s{i}", f"c.jsonl:{i}", error=f"c.jsonl:{i}: refused", retry=False)
    return Outcome(f"s{i}", f"c.jsonl:{i}", record={"prompt": f"p{i}", "input_ids": [1, 2, i]}, tokens=3,
                   prompt_tokens=2, exact=True)


def make(folder) -> tuple[RunDir, PartWriter]:
    run = RunDir(str(folder))
    run.put(REGEN_JSON, b'{"format": "hsx.regenerated", "version": "1", "settings": {}}')
    return run, PartWriter(run, "20261204T000000.000000Z-test0001")


def read(url: str, fmt: str = "regenerated") -> list:
    return [r for block in read_records(CorpusFile(url, fmt)) for r in block]


def test_only_committed_records_are_read_each_checked_against_its_row(tmp_path):
    folder = tmp_path / "corpora" / "regen"
    run, writer = make(folder)
    for i in range(3):
        writer.add(outcome(i, ok=i != 1))
    writer.flush()
    writer.add(outcome(3))
    writer.flush()
    run.put("data/part-orphan-000000.jsonl", b'{"prompt": "never committed"}\n')  # a part with no manifest row
    (tmp_path / "corpora" / "plain.jsonl").write_text('{"prompt": "a plain file beside it"}\n')

    files = expand_corpus([str(tmp_path / "corpora")])
    assert [(f.url.rsplit("/", 1)[-1], f.format) for f in files] == [("plain.jsonl", "jsonl"), ("regen", "regenerated")]
    records = read(str(folder))
    assert [r.sample_id for r in records] == ["s0", "s2", "s3"] and all(r.error is None for r in records)
    assert json.loads(records[1].payload) == {"prompt": "p2", "input_ids": [1, 2, 2]}

    # a flipped byte in a committed line: that record fails, naming the fix; the others are read
    part = next(p for p in sorted((folder / "data").iterdir()) if "orphan" not in p.name)
    raw = bytearray(part.read_bytes())
    raw[raw.index(b'"p0"') + 2] ^= 1
    part.write_bytes(bytes(raw))
    records = read(str(folder))
    assert [r.sample_id for r in records] == ["s0", "s2", "s3"]
    assert records[0].error and "do not match its manifest row" in records[0].error
    assert [r.error for r in records[1:]] == [None, None]

    assert remove_orphans(run) == 1 and not (folder / "data" / "part-orphan-000000.jsonl").exists()

    # a planted manifest row pointing outside the corpus: that record fails, nothing outside is read
    (tmp_path / "secret.jsonl").write_text('{"prompt": "outside"}\n')
    from connectors.manifest import write_manifest_part

    write_manifest_part(run, [{"sample_id": "evil", "status": "ok", "path": "../../secret.jsonl", "offset": 0,
                               "bytes": 22}], "20261204T000001.000000Z-evil0001", 0)
    evil = [r for r in read(str(folder)) if r.sample_id == "evil"]
    assert len(evil) == 1 and evil[0].payload is None and "not a plain relative path" in evil[0].error


def test_the_following_reader_reads_commits_as_they_come_and_stops_at_the_attempts_end(tmp_path):
    from connectors.lease import WriterLease

    folder = tmp_path / "regen"
    run, writer = make(folder)
    lease = WriterLease.acquire(run, writer.attempt, command="hsx regenerate")  # as the regeneration holds it
    writer.add(outcome(0))
    writer.flush()

    def later() -> None:
        time.sleep(1.5)
        writer.add(outcome(1))
        writer.flush()
        time.sleep(1.5)
        writer.add(outcome(2))
        writer.flush()
        run.put(FINISHED, b'{"attempt": "x"}')
        lease.release()

    thread = threading.Thread(target=later)
    thread.start()
    got, blocks = [], 0
    start = time.monotonic()
    for block in read_records(CorpusFile(str(folder), "regenerated-follow")):
        got += [(r.sample_id, round(time.monotonic() - start)) for r in block]
        blocks += 1
    thread.join()
    assert [sid for sid, _ in got] == ["s0", "s1", "s2"]
    assert blocks == 3 and got[0][1] < 1  # each commit handed on when read, not held back for a full block
