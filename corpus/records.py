"""A corpus record and the text rules every reader applies (corpus/readers.py reads files into them by format).

    CorpusFile(url, format)            one corpus file; .tag prefixes its records' derived sample ids
    Record(sample_id, source, payload=, error=)
                                       one line or row: its record as JSON text, or why it cannot be used
    record_from_obj(obj, id_field, derived, source)
                                       a parsed record -> Record: its id (or the derived one), its JSON text
    RECORD_SCHEMA                      the Arrow schema of record blocks; records_table(records) one such block
    invalid_unicode(text), storable_text(text), short_repr(v)     text rules of records and their error texts

A record's sample id is its `id_field` value when present, else `<file stem>-<hash of the file URL>-<line>`. Ids that
cannot be stored fail with the derived id: lone surrogates (Arrow strings, and so the Parquet manifest, hold valid
UTF-8 only), control characters, more than MAX_ID_CHARS, non-scalars. Error texts are made storable and cut to
MAX_ERROR_CHARS.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import json
import re
import uuid
from dataclasses import dataclass

import pyarrow as pa

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
MAX_ID_CHARS = 1024
"""Longest sample id kept; longer ones fail (they become file names, safetensors metadata, manifest keys)."""
MAX_ERROR_CHARS = 2000
"""Longest error text a failed record carries (errors quote hostile content)."""
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
RECORD_SCHEMA = pa.schema([("sample_id", pa.string()), ("source", pa.string()), ("payload", pa.string()),
                           ("error", pa.string())])


def records_table(records) -> pa.Table:
    """Records (each with sample_id, source, payload, error) as one RECORD_SCHEMA block."""
    return pa.Table.from_pydict({name: [getattr(r, name) for r in records] for name in RECORD_SCHEMA.names},
                                schema=RECORD_SCHEMA)


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

    def __post_init__(self) -> None:
        if self.error is not None:
            self.error = storable_text(self.error)


def invalid_unicode(text: str) -> str | None:
    """Why `text` is not valid Unicode — a lone surrogate, as a broken JSON escape such as "\\ud800" leaves — or None.

    Such text cannot be encoded as UTF-8: Arrow, Parquet and tokenizers refuse it.
    """
    m = _SURROGATE.search(text)
    return None if m is None else f"lone surrogate U+{ord(m.group()):04X} at character {m.start()}"


def storable_text(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` as an Arrow string can hold it: lone surrogates backslash-escaped, cut to at most `limit` characters."""
    if _SURROGATE.search(text):
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > limit:
        keep = limit - 40
        text = f"{text[:keep]} ... [{len(text) - keep} more characters]"
    return text


def short_repr(value, limit: int = 60) -> str:
    """repr cut short, for error texts that quote a record's values (repr escapes surrogates and control
    characters)."""
    r = repr(value)
    return r if len(r) <= limit else f"{r[:limit]}..."


def record_id(obj: dict, id_field: str, derived: str) -> tuple[str, str | None]:
    """(sample_id, error): the record's own id when it has a usable one, else the derived id."""
    if id_field not in obj or obj[id_field] is None:
        return derived, None
    value = obj[id_field]
    fix = "fix the corpus or choose another field with --id-field"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return derived, (f"field {id_field!r} must be a string or integer sample id, got {type(value).__name__} "
                         f"{short_repr(value)}; {fix}")
    value = str(value)
    if not value.strip():
        return derived, f"field {id_field!r} is an empty sample id; {fix}"
    problem = invalid_unicode(value)
    if problem:
        return derived, (f"field {id_field!r} is not valid Unicode text ({problem}), so it cannot be stored as a "
                         f"sample id; fix the escape in the corpus or choose another field with --id-field")
    control = _CONTROL.search(value)
    if control:
        return derived, (f"field {id_field!r} holds control character U+{ord(control.group()):04X} at character "
                         f"{control.start()} ({short_repr(value)}); sample ids must be printable text — {fix}")
    if len(value) > MAX_ID_CHARS:
        return derived, (f"field {id_field!r} is {len(value)} characters long ({short_repr(value)}); sample ids are at "
                         f"most {MAX_ID_CHARS} characters — {fix}")
    return value, None


def _json_value(value):
    """JSON for the values Parquet gives that json cannot encode: bytes as UTF-8 text (binary columns, as Spark
    writes strings), dates, times and decimals as text; anything else is an error naming what it is."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise TypeError("holds bytes that are not UTF-8 text; drop the column or store text in it") from None
    if isinstance(value, (datetime.date, datetime.time)):  # datetime is a date
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, datetime.timedelta, uuid.UUID)):
        return str(value)
    raise TypeError(f"holds a {type(value).__name__} value, which has no JSON form; drop or convert the column")


def _json_text(obj: dict) -> str:
    """The record as JSON text an Arrow string can hold; raises ValueError naming the field that has no JSON form."""
    try:
        text = json.dumps(obj, ensure_ascii=False, default=_json_value)
    except (TypeError, ValueError, RecursionError) as e:
        for key, value in obj.items():
            try:
                json.dumps(value, default=_json_value)
            except (TypeError, ValueError) as inner:
                raise ValueError(f"column {key!r} {inner}") from inner
            except RecursionError as inner:
                raise ValueError(f"column {key!r} is nested too deeply to encode as JSON") from inner
        raise ValueError(f"the record cannot be represented as JSON ({type(e).__name__}: {e})") from e
    if _SURROGATE.search(text):  # \u escapes keep it storable; the tokenizer reports the broken text
        text = json.dumps(obj, default=_json_value)
    return text


def record_from_obj(obj, id_field: str, derived: str, source: str, payload: str | None = None) -> Record:
    """The Record of a parsed record `obj` found at `source`: a failed one when it is no object, its id cannot be
    stored, or it has no JSON form; `payload` is its JSON text when the reader already has it."""
    if not isinstance(obj, dict):
        return Record(derived, source, error=f"{source}: a record must be a JSON object, got {type(obj).__name__}")
    sample_id, err = record_id(obj, id_field, derived)
    if err:
        return Record(sample_id, source, error=f"{source}: {err}")
    if payload is None:
        try:
            payload = _json_text(obj)
        except ValueError as e:
            return Record(sample_id, source, error=f"{source}: {e}")
    return Record(sample_id, source, payload=payload)
