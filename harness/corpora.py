"""Corpus files written for tests and benchmarks: JSONL (plain or gzipped, with raw broken lines), Parquet, and a
corpus of word prompts big enough to interrupt a job mid-run."""

from __future__ import annotations

import gzip
import json


def write_jsonl(path, records, raw_lines=()) -> str:
    """Records as JSON lines, then raw byte lines (for broken input)."""
    with open(path, "wb") as f:
        for r in records:
            f.write(json.dumps(r).encode() + b"\n")
        for line in raw_lines:
            f.write(line + b"\n")
    return str(path)


def word_corpus(tmp_path, n: int) -> tuple[str, set[str]]:
    """n prompts of 5-44 words as JSONL, and their ids: enough work for a job to be interrupted mid-run."""
    records = [{"id": f"k{i:04d}", "prompt": " ".join(["word"] * (5 + i % 40)) + f" {i}"} for i in range(n)]
    return write_jsonl(tmp_path / "words.jsonl", records), {r["id"] for r in records}


def write_jsonl_gz(path, records) -> str:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def write_parquet(path, records) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), str(path))
    return str(path)
