"""Parquet corpus files (.parquet, .pq) -> records, in row batches.

    read_parquet(file, id_field, storage_options) -> Iterator[(row, Record)]     rows from 0
    count_rows(file, storage_options) -> int                                     from the footer

A file that is not Parquet is one failed record that says so; a row some of whose strings are not UTF-8 fails alone,
naming the first bad column; values JSON cannot hold (bytes, dates, decimals) are written as text.
"""

from __future__ import annotations

from collections.abc import Iterator

import fsspec
import pyarrow as pa

from corpus.records import CorpusFile, Record, record_from_obj, record_id


def read_parquet(file: CorpusFile, id_field: str, storage_options: dict | None) -> Iterator[tuple[int, Record]]:
    import pyarrow.parquet as pq

    with fsspec.open(file.url, "rb", **(storage_options or {})) as f:
        try:
            parquet = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as e:
            source = f"{file.url}#0"
            yield 0, Record(f"{file.tag}-0", source, error=f"{source}: the file is not a readable Parquet file "
                                                           f"({type(e).__name__}: {e}); re-write it")
            return
        row = -1
        # Python file object + Arrow's CPU pool: a hang or abort at exit (apache/arrow#50482); one row group at a time
        for batch in parquet.iter_batches(batch_size=1024, use_threads=False):
            try:
                objs = batch.to_pylist()
            except UnicodeDecodeError:  # a string column holds bytes that are not UTF-8: find them row by row
                objs = None
            for i in range(batch.num_rows):
                row += 1
                derived, source = f"{file.tag}-{row}", f"{file.url}#{row}"
                if objs is not None:
                    yield row, record_from_obj(objs[i], id_field, derived, source)
                else:
                    yield row, _parquet_row(batch, i, id_field, derived, source)


def _parquet_row(batch: pa.RecordBatch, i: int, id_field: str, derived: str, source: str) -> Record:
    """Row i of a batch some of whose strings are not UTF-8, cell by cell: the first bad column fails the row."""
    obj, bad = {}, None
    for name, column in zip(batch.schema.names, batch.columns):
        try:
            obj[name] = column[i].as_py()
        except UnicodeDecodeError as e:
            bad = bad or (name, e)
    if bad is None:
        return record_from_obj(obj, id_field, derived, source)
    name, e = bad
    sample_id = record_id(obj, id_field, derived)[0]  # the derived id when the id is the bad cell
    return Record(sample_id, source, error=f"{source}: column {name!r} is not valid UTF-8 text (bad byte "
                                           f"0x{e.object[e.start]:02x} at offset {e.start}); re-write the file with "
                                           "UTF-8 strings")


def count_rows(file: CorpusFile, storage_options: dict | None = None) -> int:
    """Rows in a Parquet file, from its footer."""
    import pyarrow.parquet as pq

    with fsspec.open(file.url, "rb", **(storage_options or {})) as f:
        return pq.ParquetFile(f).metadata.num_rows
