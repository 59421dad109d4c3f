"""Corpus files -> records, streaming, with every bad line turned into a failed record instead of an exception.

    expand_corpus(patterns, storage_options) -> [CorpusFile]      globs and folders, local or any fsspec URL
    read_records(file, id_field, ...) -> Iterator[[Record]]       blocks of records, in file order
    count_records(file, storage_options) -> int                   cheap count for progress totals
    read_stage(files_batch, ...) -> Iterator[pa.Table]            the Ray Data read stage (RECORD_SCHEMA blocks)
    invalid_unicode(text), storable_text(text), short_repr(v)     text rules of records and their error texts

Formats: JSONL (.jsonl, .ndjson, .json; .gz/.bz2/.xz/.zst compressed too; a .json file holding one JSON array is
read whole) and Parquet (.parquet, .pq), read in row batches.

A record's sample id is its `id_field` value when present, else `<file stem>-<hash of the file URL>-<line>` (line
1-based in JSONL, row 0-based in Parquet) — stable across re-runs over the same files. The record itself travels on
as JSON text (`payload`); what it holds (prompt, chat, tokens) is decided at tokenization.

Hostile input stays per record: every line or row becomes exactly one Record, whatever it holds, and no record's
failure takes its block or the rest of its file with it. Ids that cannot be stored fail with the derived id: lone
surrogates (Arrow strings, and so the Parquet manifest, hold valid UTF-8 only), control characters, more than
MAX_ID_CHARS, non-scalars. Error texts are made storable and cut to MAX_ERROR_CHARS (`storable_text`). A compressed stream that
breaks off (truncated archive) ends its file with one failed record for the line it broke in, after every complete
line before it; a file that is not what its name says (.gz that is not gzip, UTF-16 text, not Parquet) is one failed
record that says so.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import json
import logging
import os
import re
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import fsspec
import pyarrow as pa

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
_COMPRESSION_NAMES = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
_GLOB_CHARS = set("*?[")
MAX_ID_CHARS = 1024
"""Longest sample id kept; longer ones fail (they become file names, safetensors metadata, manifest keys)."""
MAX_RECORD_BYTES = 256 << 20
"""Longest JSONL line read; a longer one (a file without newlines, say) fails alone and is never held in memory."""
BLOCK_BYTES = 64 << 20
"""A block of records closes once its payloads hold this many characters, however few records it has."""
MAX_ERROR_CHARS = 2000
"""Longest error text a failed record carries (errors quote hostile content)."""
_READ_SIZE = 1 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_UTF8_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
RECORD_SCHEMA = pa.schema([("sample_id", pa.string()), ("source", pa.string()), ("payload", pa.string()),
                           ("error", pa.string())])


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
            candidates = sorted(p for p in fs.find(path) if file_format(p) is not None)
        elif fs.exists(path):
            candidates = [path]
        else:
            raise ValueError(f"--corpus {pattern!r}: no such file or folder")
        matched = 0
        for p in candidates:
            url = os.path.abspath(p) if local else fs.unstrip_protocol(p)
            if _SURROGATE.search(url):  # a local name of non-UTF-8 bytes (Python keeps them as surrogates)
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


def _compression(url: str) -> str | None:
    for suffix, name in _COMPRESSION_NAMES.items():
        if url.lower().endswith(suffix):
            return name
    return None


def _record_id(obj: dict, id_field: str, derived: str) -> tuple[str, str | None]:
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


def _from_obj(obj, id_field: str, derived: str, source: str, payload: str | None = None) -> Record:
    if not isinstance(obj, dict):
        return Record(derived, source, error=f"{source}: a record must be a JSON object, got {type(obj).__name__}")
    sample_id, err = _record_id(obj, id_field, derived)
    if err:
        return Record(sample_id, source, error=f"{source}: {err}")
    if payload is None:
        try:
            payload = _json_text(obj)
        except ValueError as e:
            return Record(sample_id, source, error=f"{source}: {e}")
    return Record(sample_id, source, payload=payload)


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
    parquet = file.format == "parquet"
    last = -1 if parquet else 0  # position read last (rows from 0, lines from 1)
    try:
        records = _read_parquet(file, id_field, storage_options) if parquet else \
            _read_jsonl(file, id_field, storage_options, max_record_bytes)
        for position, record in records:
            last = position
            block.append(record)
            size += len(record.payload or "")
            if len(block) >= block_rows or size >= block_bytes:
                yield block
                block, size = [], 0
    except Exception as e:  # noqa: BLE001 - any read failure becomes a failed record of this file
        nxt = last + 1
        logger.warning("reading %s stopped after position %d: %s", file.url, last, e)
        source = f"{file.url}#{nxt}" if parquet else f"{file.url}:{nxt}"
        block.append(Record(f"{file.tag}-{nxt}", source,
                            error=f"{source}: reading stopped at {'row' if parquet else 'line'} {nxt}: "
                                  f"{type(e).__name__}: {e}"))
    if block:
        yield block


class _StreamBroke(Exception):
    """Reading the file's bytes failed (the cause is chained); raised by _Lines, turned into a failed record."""


class _Lines:
    """A byte stream cut into lines, keeping count of where it is (for the record that says where it broke)."""

    def __init__(self, read: Callable[[int], bytes], max_line: int) -> None:
        self._read = read
        self.max_line = max_line
        self.buf = bytearray()
        self.pos = 0
        """Start of the next line in buf."""
        self.offset = 0
        """Stream bytes before buf[0]."""
        self.lineno = 0
        """Lines handed out."""
        self._broke: _StreamBroke | None = None

    @property
    def total(self) -> int:
        """Bytes of the stream read so far."""
        return self.offset + len(self.buf)

    @property
    def partial(self) -> int:
        """Bytes of the next line read so far."""
        return len(self.buf) - self.pos

    def _fill(self) -> bool:
        """Read more of the stream; False at its end. Raises _StreamBroke once the stream broke, every time."""
        if self._broke is not None:
            raise self._broke
        if self.pos:
            del self.buf[: self.pos]
            self.offset += self.pos
            self.pos = 0
        try:
            chunk = self._read(_READ_SIZE)
        except Exception as e:  # noqa: BLE001 - decompression and I/O errors of any backend
            self._broke = _StreamBroke()
            self._broke.__cause__ = e
            raise self._broke from e
        self.buf += chunk
        return bool(chunk)

    def head(self, n: int) -> bytes:
        """The first n bytes (fewer when the stream is shorter or breaks off first: its lines come before that)."""
        try:
            while len(self.buf) < n and self._fill():
                pass
        except _StreamBroke:
            pass  # raised again by the read after the lines that did arrive
        return bytes(self.buf[:n])

    def rest(self) -> bytes:
        while self._fill():
            pass
        return bytes(self.buf[self.pos:])

    def __iter__(self) -> Iterator[tuple[int, bytes | int]]:
        """(line number, the line without its newline), or (line number, its length) for a line over max_line."""
        searched = 0  # bytes of the pending line already searched for a newline
        while True:
            nl = self.buf.find(b"\n", self.pos + searched)
            if nl >= 0:
                self.lineno += 1
                line = bytes(self.buf[self.pos:nl])
                self.pos, searched = nl + 1, 0
                yield self.lineno, line
                continue
            searched = self.partial
            if searched > self.max_line:
                length = self._drop_line()
                self.lineno += 1
                searched = 0
                yield self.lineno, length
                continue
            if not self._fill():
                if self.partial:  # a last line without a newline
                    self.lineno += 1
                    line = bytes(self.buf[self.pos:])
                    self.pos = len(self.buf)
                    yield self.lineno, line
                return

    def _drop_line(self) -> int:
        """Skip the rest of the pending (over-long) line, never holding more than one read of it; its length."""
        length = self.partial
        self.pos = len(self.buf)
        while self._fill():
            nl = self.buf.find(b"\n")
            if nl >= 0:
                self.pos = nl + 1
                return length + nl
            length += len(self.buf)
            self.pos = len(self.buf)
        return length


def _read_jsonl(file: CorpusFile, id_field: str, storage_options: dict | None,
                max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[tuple[int, Record]]:
    name = file.url.lower()
    for suffix in COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    with fsspec.open(file.url, "rb", compression="infer", **(storage_options or {})) as f:
        # read1: one decompression step per call, so a stream that breaks off loses only what it could not give
        lines = _Lines(getattr(f, "read1", None) or f.read, max_record_bytes)
        try:
            head = lines.head(1 << 16)
            if head[:2] in _UTF16_BOMS:
                source = f"{file.url}:1"
                yield 1, Record(f"{file.tag}-1", source, error=(
                    f"{source}: the file is UTF-16 or UTF-32 text (it starts with the byte order mark "
                    f"{head[:2].hex(' ').upper()}); hsx reads UTF-8: convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)"))
                return
            if name.endswith(".json") and head.removeprefix(_UTF8_BOM).lstrip()[:1] == b"[":
                yield from _read_json_array(file, id_field, lines.rest())
                return
            for lineno, line in lines:
                record = _parse_line(file, id_field, lineno, line, max_record_bytes)
                if record is not None:
                    yield lineno, record
        except _StreamBroke as e:
            yield lines.lineno + 1, _broken_stream(file, lines, e.__cause__)


def _broken_stream(file: CorpusFile, lines: _Lines, cause: BaseException) -> Record:
    """The failed record for the line a stream broke in."""
    n = lines.lineno + 1
    source = f"{file.url}:{n}"
    compression = _compression(file.url)
    what = f"{type(cause).__name__}: {cause}"
    if compression and lines.total == 0 and not isinstance(cause, EOFError):
        msg = (f"the file is not {compression}-compressed despite its name ({what}); rename it to what it holds or "
               f"compress it with {compression}")
    elif isinstance(cause, EOFError):
        where = (f"inside line {n}, after byte {lines.total} of its text ({lines.partial} bytes of that line)"
                 if lines.partial else f"after line {n - 1}, at byte {lines.total} of its text")
        msg = (f"the file is truncated: its {compression or 'compressed'} stream ends {where}; the lines before it "
               "were read, the rest of the file is lost — re-download or re-create the file and run again")
    else:
        msg = (f"reading stopped at line {n}, byte {lines.total} of the text ({what}); the lines before it were "
               "read — check the file (a corrupt archive?) and run again")
    logger.warning("%s", msg)
    return Record(f"{file.tag}-{n}", source, error=f"{source}: {msg}")


def _parse_line(file: CorpusFile, id_field: str, lineno: int, raw: bytes | int,
                max_record_bytes: int = MAX_RECORD_BYTES) -> Record | None:
    derived, source = f"{file.tag}-{lineno}", f"{file.url}:{lineno}"
    length = raw if isinstance(raw, int) else len(raw)
    if length > max_record_bytes:
        return Record(derived, source, error=f"{source}: line is {length} bytes long, over the {max_record_bytes}-"
                                             "byte record limit; split the record (or a file without newlines?)")
    # CRLF line ends; a byte order mark opens the file, or a file concatenated onto another
    raw = raw.rstrip(b"\r").removeprefix(_UTF8_BOM)
    if not raw.strip():
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Record(derived, source, error=f"{source}: line is not valid UTF-8 (bad byte 0x{raw[e.start]:02x} at "
                                             f"offset {e.start}); the corpus must be UTF-8 text")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return Record(derived, source, error=f"{source}: malformed JSON at column {e.colno}: {e.msg}")
    except RecursionError:
        return Record(derived, source, error=f"{source}: the JSON is nested too deeply to parse (about "
                                             f"{sys.getrecursionlimit()} levels at most); flatten the record")
    except ValueError as e:  # json's own limits, beyond JSONDecodeError
        msg = f"the JSON cannot be parsed ({e})"
        if "integer string conversion" in str(e):
            msg = (f"the JSON holds an integer of more than {sys.get_int_max_str_digits()} digits; store such "
                   "numbers as strings")
        return Record(derived, source, error=f"{source}: {msg}")
    return _from_obj(obj, id_field, derived, source, payload=text)


def _read_json_array(file: CorpusFile, id_field: str, data: bytes) -> Iterator[tuple[int, Record]]:
    try:
        items = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        source = f"{file.url}:1"
        yield 1, Record(f"{file.tag}-1", source, error=f"{source}: not a valid JSON array file "
                                                       f"({type(e).__name__}: {e}); fix it or write it as JSONL")
        return
    for i, obj in enumerate(items):
        yield i + 1, _from_obj(obj, id_field, f"{file.tag}-{i + 1}", f"{file.url}:{i + 1}")


def _read_parquet(file: CorpusFile, id_field: str, storage_options: dict | None) -> Iterator[tuple[int, Record]]:
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
        for batch in parquet.iter_batches(batch_size=1024):
            try:
                objs = batch.to_pylist()
            except UnicodeDecodeError:  # a string column holds bytes that are not UTF-8: find them row by row
                objs = None
            for i in range(batch.num_rows):
                row += 1
                derived, source = f"{file.tag}-{row}", f"{file.url}#{row}"
                if objs is not None:
                    yield row, _from_obj(objs[i], id_field, derived, source)
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
        return _from_obj(obj, id_field, derived, source)
    name, e = bad
    sample_id = _record_id(obj, id_field, derived)[0]  # the derived id when the id is the bad cell
    return Record(sample_id, source, error=f"{source}: column {name!r} is not valid UTF-8 text (bad byte "
                                           f"0x{e.object[e.start]:02x} at offset {e.start}); re-write the file with "
                                           "UTF-8 strings")


def count_records(file: CorpusFile, storage_options: dict | None = None) -> int:
    """Records in a file, for progress totals: Parquet from its footer, JSONL by counting lines (an upper bound)."""
    if file.format == "parquet":
        import pyarrow.parquet as pq

        with fsspec.open(file.url, "rb", **(storage_options or {})) as f:
            return pq.ParquetFile(f).metadata.num_rows
    n, last = 0, b"\n"
    with fsspec.open(file.url, "rb", compression="infer", **(storage_options or {})) as f:
        while chunk := f.read(1 << 22):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def read_stage(files: pa.Table, *, id_field: str, storage_options: dict, registry) -> Iterator[pa.Table]:
    """Ray Data read stage: corpus files -> record blocks, minus committed ids; duplicate ids become failed records.

    `registry` is the SampleRegistry actor (see registry.py); one claim call per block.
    """
    import ray

    from jobs.registry import SKIP

    for url, fmt in zip(files["url"].to_pylist(), files["format"].to_pylist()):
        for records in read_records(CorpusFile(url, fmt), id_field, storage_options):
            verdicts = ray.get(registry.claim.remote([r.sample_id for r in records], [r.source for r in records]))
            keep = [r if v is None else Record(r.sample_id, r.source, error=v)
                    for r, v in zip(records, verdicts) if v != SKIP]
            if keep:
                yield pa.Table.from_pydict({"sample_id": [r.sample_id for r in keep],
                                            "source": [r.source for r in keep],
                                            "payload": [r.payload for r in keep],
                                            "error": [r.error for r in keep]}, schema=RECORD_SCHEMA)
