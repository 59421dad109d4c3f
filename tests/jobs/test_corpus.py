"""Corpus reading: formats, globs, sample ids, and bad input turned into failed records (no Ray)."""

from __future__ import annotations

import json

import pytest

from corpus.readers import count_records, expand_corpus, read_records
from harness.corpora import write_jsonl, write_jsonl_gz, write_parquet


def _records(files, id_field="id"):
    return [r for f in files for block in read_records(f, id_field, block_rows=3) for r in block]


def test_globs_folders_and_files_expand_to_supported_files(tmp_path):
    (tmp_path / "sub").mkdir()
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}])
    b = write_parquet(tmp_path / "sub" / "b.parquet", [{"prompt": "y"}])
    c = write_jsonl_gz(tmp_path / "sub" / "c.jsonl.gz", [{"prompt": "z"}])
    (tmp_path / "notes.txt").write_text("ignored by globs and folders")
    assert [f.url for f in expand_corpus([str(tmp_path / "*")])] == [a]
    assert [f.url for f in expand_corpus([str(tmp_path)])] == sorted([a, b, c])
    assert [f.format for f in expand_corpus([b, a, a])] == ["jsonl", "parquet"]  # sorted, de-duplicated


def test_corpus_that_matches_nothing_or_has_an_unknown_type_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        expand_corpus([str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValueError, match="matches no"):
        expand_corpus([str(tmp_path / "*.jsonl")])
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="cannot read"):
        expand_corpus([str(tmp_path / "data.csv")])


def test_every_format_yields_records_with_ids_and_sources(tmp_path):
    files = expand_corpus([
        write_jsonl(tmp_path / "a.jsonl", [{"id": "x1", "prompt": "p"}, {"prompt": "q"}]),
        write_parquet(tmp_path / "b.parquet", [{"id": 7, "input_ids": [1, 2]}, {"id": None, "input_ids": [3]}]),
        write_jsonl_gz(tmp_path / "c.jsonl.gz", [{"conversations": [{"from": "human", "value": "hi"}]}]),
    ])
    (tmp_path / "d.json").write_text(json.dumps([{"prompt": "in an array"}]))
    files += expand_corpus([str(tmp_path / "d.json")])
    recs = _records(files)
    assert [r.error for r in recs] == [None] * 6
    assert recs[0].sample_id == "x1" and recs[0].source.endswith("a.jsonl:1")
    assert recs[1].sample_id == f"{files[0].tag}-2" and recs[1].sample_id.startswith("a-")
    assert recs[2].sample_id == "7" and recs[2].source.endswith("b.parquet#0")
    assert recs[3].sample_id == f"{files[1].tag}-1"  # null id -> derived from the row
    assert json.loads(recs[4].payload)["conversations"][0]["value"] == "hi"
    assert json.loads(recs[5].payload) == {"prompt": "in an array"}
    # derived ids are stable across reads
    assert [r.sample_id for r in _records(files)] == [r.sample_id for r in recs]


def test_bad_lines_become_failed_records_with_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"id": "good", "prompt": "fine"}], raw_lines=[
        b'{"id": "x", "prompt": ',          # line 2: malformed JSON
        b"",                                 # line 3: blank lines are skipped
        b'{"prompt": "caf\xe9"}',           # line 4: Latin-1 byte, not UTF-8
        b"[1, 2]",                           # line 5: not an object
        b'{"id": {"a": 1}, "prompt": "x"}',  # line 6: unusable id
        b'{"id": "", "prompt": "x"}',        # line 7: empty id
    ])
    recs = _records(expand_corpus([path]))
    assert [r.sample_id for r in recs][:1] == ["good"] and recs[0].error is None
    errors = {r.source.rsplit(":", 1)[1]: r.error for r in recs[1:]}
    assert set(errors) == {"2", "4", "5", "6", "7"}
    assert "malformed JSON" in errors["2"] and f"{path}:2" in errors["2"]
    assert "not valid UTF-8" in errors["4"] and "0xe9" in errors["4"]
    assert "JSON object" in errors["5"]
    assert "string or integer" in errors["6"]
    assert "empty sample id" in errors["7"]


def test_truncated_archive_keeps_every_complete_line_across_many_reads(tmp_path):
    import random
    import zlib

    rng = random.Random(0)
    records = [{"id": f"r{i}", "prompt": "".join(rng.choice("abcdefgh ") for _ in range(400))} for i in range(3000)]
    path = write_jsonl_gz(tmp_path / "cut.jsonl.gz", records)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    complete = zlib.decompressobj(wbits=31).decompress(data[: len(data) // 2]).count(b"\n")  # the oracle: zlib
    recs = _records(expand_corpus([path]))
    assert complete > 1000 and [r.sample_id for r in recs[:-1]] == [f"r{i}" for i in range(complete)]
    assert all(r.error is None for r in recs[:-1])
    assert recs[-1].source == f"{path}:{complete + 1}" and "the file is truncated" in recs[-1].error


def test_count_records_counts_lines_and_parquet_rows(tmp_path):
    files = expand_corpus([write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}] * 5),
                           write_parquet(tmp_path / "b.parquet", [{"prompt": "y"}] * 7)])
    assert [count_records(f) for f in files] == [5, 7]
