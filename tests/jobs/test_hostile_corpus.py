"""Hostile input: every record of a corpus built to break hsx ends as exactly one row — ok, or failed with a reason
that names file:line and the fix — in the reader, in the tokenize stage and through a whole job on Ray.

tests/jobs/data/hostile.jsonl holds one record per case (HOSTILE says what becomes of each line); the truncated
gzip, the hostile Parquet file and the other broken files are built by fixtures here.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest

from corpus.readers import RECORD_SCHEMA, Record, expand_corpus, read_records
from corpus.tokenization import SAMPLE_SCHEMA, SampleTokenizer, TokenizeSettings, tokenize_table

HOSTILE_JSONL = Path(__file__).parent / "data" / "hostile.jsonl"

OK, READ, TOKENIZE = "ok", "fails in the reader", "fails in the tokenize stage"


@dataclass(frozen=True)
class Case:
    name: str
    sample_id: str | None
    """The record's own id; None: the id derived from file and line (`<tag>-<line>`)."""
    outcome: str
    error: str = ""
    """What the failure says (a substring)."""


HOSTILE = {  # line of hostile.jsonl -> what becomes of it; lines 4 and 47 are blank and make no record
    1: Case("utf8-bom-at-file-start", "bom-first", OK),
    2: Case("crlf-line-ending", "crlf", OK),
    3: Case("plain-record", "plain", OK),
    5: Case("id-lone-high-surrogate", None, READ, "field 'id' is not valid Unicode text (lone surrogate U+D800"),
    6: Case("id-surrogate-pair", "pair-\U0001f600", OK),
    7: Case("id-lone-low-surrogate", None, READ, "not valid Unicode text (lone surrogate U+DC00 at character 4)"),
    8: Case("id-with-nul", None, READ, "control character U+0000 at character 4"),
    9: Case("id-with-terminal-escape", None, READ, "control character U+001B at character 4"),
    10: Case("id-list", None, READ, "must be a string or integer sample id, got list"),
    11: Case("id-dict", None, READ, "must be a string or integer sample id, got dict"),
    12: Case("id-bool", None, READ, "must be a string or integer sample id, got bool"),
    13: Case("id-float", None, READ, "must be a string or integer sample id, got float"),
    14: Case("id-null", None, OK),
    15: Case("id-big-integer", "123456789012345678901234567890", OK),
    16: Case("id-5000-characters", None, READ, "is 5000 characters long"),
    17: Case("id-blank", None, READ, "empty sample id"),
    18: Case("prompt-lone-surrogate", "surrogate-prompt", TOKENIZE,
             "field 'prompt' is not valid Unicode text (lone surrogate U+D800 at character 9)"),
    19: Case("openai-content-lone-surrogate", "surrogate-chat", TOKENIZE,
             "messages[0].content is not valid Unicode text (lone surrogate U+DFFF at character 3)"),
    20: Case("sharegpt-value-lone-surrogate", "surrogate-sharegpt", TOKENIZE,
             "conversations[1].value is not valid Unicode text (lone surrogate U+D83D at character 0)"),
    21: Case("prompt-surrogate-pair", "emoji-prompt", OK),
    22: Case("prompt-with-nul-and-escape", "controls-in-prompt", OK),
    23: Case("input-ids-beyond-int64", "ids-beyond-int64", TOKENIZE, "input_ids[1] is 1180591620717411303424"),
    24: Case("input-ids-negative", "ids-negative", TOKENIZE, "input_ids[1] is -3"),
    25: Case("input-ids-float", "ids-float", TOKENIZE, "input_ids[1] is 2.0"),
    26: Case("input-ids-bool", "ids-bool", TOKENIZE, "input_ids[0] is True"),
    27: Case("input-ids-string", "ids-string", TOKENIZE, "field 'input_ids' must be a list of token ids, got str"),
    28: Case("input-ids-nested", "ids-nested", TOKENIZE, "input_ids[0] is [1, 2]"),
    29: Case("input-ids-empty", "ids-empty", TOKENIZE, "empty sample (0 tokens)"),
    30: Case("loss-mask-too-short", "mask-short", TOKENIZE, "'loss_mask' has 2 values for 3 input_ids"),
    31: Case("loss-mask-value-2", "mask-two", TOKENIZE, "loss_mask[1] is 2; give 0 or 1 per token"),
    32: Case("loss-mask-value-half", "mask-half", TOKENIZE, "loss_mask[0] is 0.5; give 0 or 1 per token"),
    33: Case("loss-mask-string", "mask-string", TOKENIZE, "field 'loss_mask' must be a list of 0/1 values, got str"),
    34: Case("pretokenized-record", "tokens-good", OK),
    35: Case("json-nested-100000-deep", None, READ, "nested too deeply"),
    36: Case("line-after-the-deep-one", "after-deep", OK),
    37: Case("json-integer-of-5000-digits", None, READ, "an integer of more than 4300 digits"),
    38: Case("line-after-the-huge-number", "after-huge-number", OK),
    39: Case("binary-garbage", None, READ, "line is not valid UTF-8 (bad byte 0x89 at offset 0)"),
    40: Case("nul-bytes", None, READ, "malformed JSON"),
    41: Case("utf8-bom-mid-file", "bom-mid", OK),
    42: Case("json-array-line", None, READ, "a record must be a JSON object, got list"),
    43: Case("json-string-line", None, READ, "a record must be a JSON object, got str"),
    44: Case("no-known-field", "no-shape", TOKENIZE, "none of the fields"),
    45: Case("null-fields-are-absent", "nulls-are-absent", OK),
    46: Case("role-of-100000-characters", "huge-role", TOKENIZE, "unknown role 'rrrr"),
    48: Case("last-line-without-newline", "last-line", OK),
}
BLANK_LINES = (4, 47)
MAX_ERROR_CHARS = 2000  # what a failed row's error may hold, whatever it quotes


def _line_of(source: str) -> int:
    return int(source.rsplit(":", 1)[1])


def _storable(*texts: str | None) -> bool:
    """Arrow strings (and so the Parquet manifest) hold valid UTF-8 only."""
    try:
        for text in texts:
            if text is not None:
                text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@pytest.fixture(scope="module")
def hostile_file():
    (file,) = expand_corpus([str(HOSTILE_JSONL)])
    return file


@pytest.fixture(scope="module")
def hostile_records(hostile_file):
    return [r for block in read_records(hostile_file) for r in block]


@pytest.fixture(scope="module")
def sample_tokenizer(tmp_path_factory):
    from reference.tiny_models import build_tokenizer

    path = str(tmp_path_factory.mktemp("tok"))
    build_tokenizer(path)
    return SampleTokenizer(TokenizeSettings(tokenizer=path, max_prompt_tokens=256))


def _record_table(records) -> pa.Table:
    return pa.Table.from_pylist([{"sample_id": r.sample_id, "source": r.source, "payload": r.payload,
                                  "error": r.error} for r in records], schema=RECORD_SCHEMA)


def _expected_id(case: Case, file, line: int) -> str:
    return case.sample_id if case.sample_id is not None else f"{file.tag}-{line}"


# -- the reader -----------------------------------------------------------------------------------------------------
def test_the_reader_makes_one_storable_record_of_every_hostile_line(hostile_file, hostile_records):
    lines = [_line_of(r.source) for r in hostile_records]
    assert lines == sorted(HOSTILE), "a line was lost, read twice or out of order"
    raw = HOSTILE_JSONL.read_bytes().split(b"\n")
    assert [i for i, line in enumerate(raw, 1) if not line.strip()] == list(BLANK_LINES)
    assert all(_storable(r.sample_id, r.source, r.payload, r.error) for r in hostile_records)
    assert _record_table(hostile_records).num_rows == len(HOSTILE)


@pytest.mark.parametrize("line", sorted(HOSTILE), ids=[HOSTILE[n].name for n in sorted(HOSTILE)])
def test_reader_outcome_per_hostile_line(hostile_file, hostile_records, line):
    case = HOSTILE[line]
    (record,) = [r for r in hostile_records if _line_of(r.source) == line]
    assert record.source == f"{hostile_file.url}:{line}"
    assert record.sample_id == _expected_id(case, hostile_file, line)
    if case.outcome == READ:
        assert record.payload is None
        assert record.error.startswith(f"{hostile_file.url}:{line}: ") and case.error in record.error, record.error
        assert len(record.error) <= MAX_ERROR_CHARS
    else:
        assert record.error is None, record.error
        assert isinstance(json.loads(record.payload), dict)


# -- the tokenize stage -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hostile_samples(sample_tokenizer, hostile_records):
    return tokenize_table(sample_tokenizer, _record_table(hostile_records))


def test_the_tokenize_stage_keeps_every_row_of_a_hostile_block(hostile_samples, hostile_records):
    assert hostile_samples.schema == SAMPLE_SCHEMA
    assert hostile_samples["source"].to_pylist() == [r.source for r in hostile_records]
    assert hostile_samples["sample_id"].to_pylist() == [r.sample_id for r in hostile_records]


@pytest.mark.parametrize("line", sorted(HOSTILE), ids=[HOSTILE[n].name for n in sorted(HOSTILE)])
def test_tokenize_outcome_per_hostile_line(hostile_file, hostile_samples, sample_tokenizer, line):
    case = HOSTILE[line]
    (row,) = [r for r in hostile_samples.to_pylist() if _line_of(r["source"]) == line]
    assert row["sample_id"] == _expected_id(case, hostile_file, line)
    if case.outcome == OK:
        assert row["error"] is None, row["error"]
        assert row["num_prompt_tokens"] == len(row["prompt_token_ids"]) == len(row["loss_mask"]) > 0
        return
    assert row["prompt_token_ids"] == [] and row["num_prompt_tokens"] == 0
    assert row["error"].startswith(f"{hostile_file.url}:{line}: ") and case.error in row["error"], row["error"]
    assert len(row["error"]) <= MAX_ERROR_CHARS


def test_one_record_beyond_int64_does_not_take_its_block_with_it(sample_tokenizer):
    block = _record_table([Record("a", "f.jsonl:1", json.dumps({"prompt": "fine"})),
                           Record("b", "f.jsonl:2", json.dumps({"input_ids": [5, 2**70]})),
                           Record("c", "f.jsonl:3", json.dumps({"input_ids": [5, 2**63 - 1]}))])
    out = tokenize_table(sample_tokenizer, block).to_pylist()
    assert [r["sample_id"] for r in out] == ["a", "b", "c"]
    assert out[0]["error"] is None and out[2]["prompt_token_ids"] == [5, 2**63 - 1]  # the engine judges the vocab
    assert out[1]["error"].startswith("f.jsonl:2: input_ids[1] is 1180591620717411303424; token ids are")


def test_good_hostile_records_tokenize_like_the_tokenizer_itself(hostile_samples, sample_tokenizer):
    rows = {r["sample_id"]: r for r in hostile_samples.to_pylist()}
    tok = sample_tokenizer.tokenizer
    assert rows["emoji-prompt"]["prompt_token_ids"] == tok("A valid pair \U0001f600 tokenizes.").input_ids
    assert rows["controls-in-prompt"]["prompt_token_ids"] == tok("NUL \x00 and ESC \x1b are text to a "
                                                                 "tokenizer.").input_ids
    assert rows["nulls-are-absent"]["prompt_token_ids"] == tok("Null fields do not pick the shape.").input_ids
    assert (rows["tokens-good"]["prompt_token_ids"], rows["tokens-good"]["loss_mask"]) == ([5, 6, 7], [0, 1, 1])


# -- broken files ------------------------------------------------------------------------------------------------------
def _cut_gzip(path: Path, n: int, keep: float) -> tuple[str, bytes]:
    """A .jsonl.gz of n records cut to `keep` of its bytes; returns (path, the text the cut file still decompresses
    to) — the oracle, by zlib directly."""
    import random

    rng = random.Random(0)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"cut-{i}", "prompt": "".join(rng.choice("abcdefgh ") for _ in range(300))})
                    + "\n")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    text = zlib.decompressobj(wbits=31).decompress(path.read_bytes())
    return str(path), text


def test_truncated_gzip_yields_every_complete_line_then_one_row_for_the_truncation(tmp_path):
    path, text = _cut_gzip(tmp_path / "cut.jsonl.gz", 60, 0.5)
    complete = text.count(b"\n")
    assert 0 < complete < 60 and not text.endswith(b"\n")
    (file,) = expand_corpus([path])
    recs = [r for block in read_records(file) for r in block]
    assert [r.sample_id for r in recs[:-1]] == [f"cut-{i}" for i in range(complete)]
    assert all(r.error is None for r in recs[:-1])
    last = recs[-1]
    assert (last.sample_id, last.source) == (f"{file.tag}-{complete + 1}", f"{path}:{complete + 1}")
    assert last.error.startswith(f"{path}:{complete + 1}: ") and "truncated" in last.error
    assert f"ends inside line {complete + 1}, after byte {len(text)} of its text" in last.error


def test_gz_file_that_is_not_gzip_is_one_row_that_says_so(tmp_path):
    path = tmp_path / "plain.jsonl.gz"
    path.write_text('{"prompt": "plain text"}\n' * 3)
    (file,) = expand_corpus([str(path)])
    (rec,) = [r for block in read_records(file) for r in block]
    assert rec.source == f"{path}:1" and rec.payload is None
    assert "is not gzip-compressed despite its name" in rec.error


def test_empty_files_make_no_records_and_an_empty_parquet_file_says_it_is_not_parquet(tmp_path):
    for name in ("empty.jsonl", "empty.jsonl.gz", "empty.parquet"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "blank.jsonl").write_bytes(b"\n  \r\n\n")
    files = {Path(f.url).name: f for f in expand_corpus([str(tmp_path)])}
    records = {name: [r for block in read_records(f) for r in block] for name, f in files.items()}
    assert records["empty.jsonl"] == records["empty.jsonl.gz"] == records["blank.jsonl"] == []
    (rec,) = records["empty.parquet"]
    assert rec.source.endswith("empty.parquet#0") and "is not a readable Parquet file" in rec.error


def test_utf16_file_is_one_row_that_says_to_convert_it(tmp_path):
    path = tmp_path / "utf16.jsonl"
    path.write_bytes('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n'.encode("utf-16"))
    (file,) = expand_corpus([str(path)])
    (rec,) = [r for block in read_records(file) for r in block]
    assert rec.source == f"{path}:1" and "UTF-16" in rec.error and "convert it to UTF-8" in rec.error


def test_a_50_mb_line_is_one_record_and_closes_its_block(tmp_path):
    path = tmp_path / "big.jsonl"
    big = json.dumps({"id": "big", "prompt": "short prompt", "padding": "p" * (50 << 20)})
    path.write_text("\n".join([json.dumps({"id": "before", "prompt": "x"}), big,
                               json.dumps({"id": "after", "prompt": "y"})]) + "\n")
    (file,) = expand_corpus([str(path)])
    blocks = [[r.sample_id for r in block] for block in read_records(file, block_bytes=1 << 20)]
    assert blocks == [["before", "big"], ["after"]]  # a block closes once it holds block_bytes of payload
    (rec,) = [r for block in read_records(file) for r in block if r.sample_id == "big"]
    assert rec.payload == big and rec.error is None


def test_a_line_longer_than_the_record_limit_fails_alone_and_the_next_line_is_read(tmp_path):
    path = tmp_path / "long.jsonl"
    long_line = json.dumps({"id": "b", "prompt": "y" * 5000})
    path.write_text("\n".join([json.dumps({"id": "a", "prompt": "x"}), long_line, json.dumps({"id": "c"})]) + "\n")
    (file,) = expand_corpus([str(path)])
    recs = [r for block in read_records(file, max_record_bytes=1000) for r in block]
    assert [(r.sample_id, r.error is None) for r in recs] == [("a", True), (f"{file.tag}-2", False), ("c", True)]
    assert f"{path}:2: line is {len(long_line)} bytes long, over the 1000-byte record limit" in recs[1].error


def test_json_array_file_with_a_lone_surrogate_keeps_its_payload_storable(tmp_path, sample_tokenizer):
    path = tmp_path / "array.json"
    path.write_text(json.dumps([{"id": "fine", "prompt": "caf\u00e9"}, {"id": "broken", "prompt": "a \ud800 b"}]))
    (file,) = expand_corpus([str(path)])
    recs = [r for block in read_records(file) for r in block]
    assert [r.error for r in recs] == [None, None]
    assert all(_storable(r.payload) for r in recs)
    out = tokenize_table(sample_tokenizer, _record_table(recs)).to_pylist()
    assert out[0]["error"] is None and out[0]["prompt_token_ids"] == sample_tokenizer.tokenizer("caf\u00e9").input_ids
    assert "field 'prompt' is not valid Unicode text (lone surrogate U+D800 at character 2)" in out[1]["error"]


def test_corpus_file_whose_name_is_not_utf8_is_refused_before_the_job_starts(tmp_path):
    os.close(os.open(os.path.join(os.fsencode(tmp_path), b"bad-\xff.jsonl"), os.O_CREAT | os.O_WRONLY))
    with pytest.raises(ValueError, match="is not valid UTF-8; rename it"):
        expand_corpus([str(tmp_path)])


# -- a hostile Parquet file -----------------------------------------------------------------------------------------
def _invalid_utf8_strings(values: list[bytes | None]) -> pa.Array:
    """A string column holding bytes that are not UTF-8, as broken writers leave them (Arrow does not check)."""
    b = pa.array(values, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(b), b.buffers(), null_count=b.null_count)


PARQUET_ROWS = [  # row -> (sample id or None for the derived one, error substring or None for a good record)
    ("pq-good", None),
    (None, "column 'id' is not valid UTF-8 text (bad byte 0xff at offset 0)"),
    ("pq-bad-prompt", "column 'prompt' is not valid UTF-8 text (bad byte 0xe9 at offset 3)"),
    ("pq-float-ids", "input_ids[0] is 1.0"),
    ("pq-binary-blob", "column 'blob' holds bytes that are not UTF-8 text"),
    ("pq-text-blob", None),
]


@pytest.fixture(scope="module")
def hostile_parquet(tmp_path_factory) -> str:
    import datetime
    import decimal

    import pyarrow.parquet as pq

    path = str(tmp_path_factory.mktemp("pq") / "hostile.parquet")
    table = pa.table({
        "id": _invalid_utf8_strings([b"pq-good", b"\xff\xfe", b"pq-bad-prompt", b"pq-float-ids", b"pq-binary-blob",
                                     b"pq-text-blob"]),
        "prompt": _invalid_utf8_strings([b"A good Parquet row.", b"x", b"caf\xe9", None, b"y", b"z"]),
        "input_ids": pa.array([None, None, None, [1.0, 2.0], None, None], pa.list_(pa.float64())),
        "created": pa.array([datetime.datetime(2024, 1, 1)] * 6, pa.timestamp("us")),
        "score": pa.array([decimal.Decimal("1.50")] * 6, pa.decimal128(5, 2)),
        "blob": pa.array([None, None, None, None, b"\x89PNG\xff", b"text as bytes"], pa.binary()),
    })
    pq.write_table(table, path, row_group_size=4)
    return path


def test_hostile_parquet_rows_each_become_one_record(hostile_parquet, sample_tokenizer):
    (file,) = expand_corpus([hostile_parquet])
    recs = [r for block in read_records(file) for r in block]
    assert [r.source for r in recs] == [f"{hostile_parquet}#{i}" for i in range(len(PARQUET_ROWS))]
    samples = tokenize_table(sample_tokenizer, _record_table(recs)).to_pylist()
    for i, ((sample_id, error), row) in enumerate(zip(PARQUET_ROWS, samples)):
        assert row["sample_id"] == (sample_id or f"{file.tag}-{i}")
        if error is None:
            assert row["error"] is None and row["num_prompt_tokens"] > 0, row["error"]
        else:
            assert row["error"].startswith(f"{hostile_parquet}#{i}: ") and error in row["error"], row["error"]
    payload = json.loads(recs[0].payload)  # timestamps and decimals travel as text
    assert (payload["created"], payload["score"]) == ("2024-01-01T00:00:00", "1.50")
    assert json.loads(recs[5].payload)["blob"] == "text as bytes"


# -- a whole job over all of it ---------------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_a_job_over_the_hostile_corpus_writes_one_row_per_record_and_succeeds(ray_cluster, tiny_llama, tmp_path,
                                                                             hostile_parquet):
    from connectors.manifest import read_manifest
    from jobs.config import JobConfig
    from jobs.pipeline import run_job

    cut, text = _cut_gzip(tmp_path / "cut.jsonl.gz", 24, 0.5)
    complete = text.count(b"\n")
    (tmp_path / "plain.jsonl.gz").write_text('{"prompt": "not gzip"}\n')
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "big.jsonl").write_text(json.dumps({"id": "big", "prompt": "short", "padding": "p" * (50 << 20)}))
    corpus = (str(HOSTILE_JSONL), cut, hostile_parquet, *(str(tmp_path / n) for n in
                                                          ("plain.jsonl.gz", "empty.jsonl", "big.jsonl")))
    files = {f.url: f for f in expand_corpus(corpus)}
    expected: dict[str, tuple[str, str | None]] = {}  # source -> (sample id, error substring or None)
    hostile = files[str(HOSTILE_JSONL)]
    for line, case in HOSTILE.items():
        expected[f"{hostile.url}:{line}"] = (_expected_id(case, hostile, line), case.error or None)
    for i in range(complete):
        expected[f"{cut}:{i + 1}"] = (f"cut-{i}", None)
    expected[f"{cut}:{complete + 1}"] = (f"{files[cut].tag}-{complete + 1}", "truncated")
    for i, (sample_id, error) in enumerate(PARQUET_ROWS):
        expected[f"{hostile_parquet}#{i}"] = (sample_id or f"{files[hostile_parquet].tag}-{i}", error)
    plain = str(tmp_path / "plain.jsonl.gz")
    expected[f"{plain}:1"] = (f"{files[plain].tag}-1", "not gzip-compressed")
    expected[f"{tmp_path / 'big.jsonl'}:1"] = ("big", None)

    output = str(tmp_path / "out")
    result = run_job(JobConfig(model=tiny_llama, corpus=corpus, output=output, workers=1, progress=False))
    rows = read_manifest(output).to_pylist()
    assert sorted(r["source"] for r in rows) == sorted(expected), "a record has no row, or more than one"
    for row in rows:
        sample_id, error = expected[row["source"]]
        assert row["sample_id"] == sample_id
        if error is None:
            assert (row["status"], row["error"]) == ("ok", None)
            assert row["num_prompt_tokens"] > 0 and os.path.getsize(os.path.join(output, row["path"])) == row["bytes"]
        else:
            assert row["status"] == "failed" and error in row["error"], row
            assert row["error"].startswith(row["source"] + ": ")
    assert result.ok == sum(e is None for _, e in expected.values())
    assert result.failed == sum(e is not None for _, e in expected.values())
