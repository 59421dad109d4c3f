"""JSONL corpus files (.jsonl, .ndjson, .json; .gz/.bz2/.xz/.zst compressed too) -> records, line by line.

    read_jsonl(file, id_field, storage_options, max_record_bytes) -> Iterator[(line, Record)]
    count_lines(file, storage_options) -> int      an upper bound on its records, for progress totals

A .json file holding one JSON array is read whole. Every line becomes exactly one Record, whatever it holds: a line
over `max_record_bytes` fails alone and is never held in memory; CRLF and byte order marks are tolerated; bad UTF-8,
malformed or too deeply nested JSON fail their line. A compressed stream that breaks off (truncated archive) ends the
file with one failed record for the line it broke in, after every complete line before it; a file that is not what
its name says (.gz that is not gzip, UTF-16 text) is one failed record that says so.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator

import fsspec

from corpus.records import COMPRESSION_SUFFIXES, CorpusFile, Record, record_from_obj

logger = logging.getLogger(__name__)

MAX_RECORD_BYTES = 256 << 20
"""Longest JSONL line read; a longer one (a file without newlines, say) fails alone and is never held in memory."""
_COMPRESSION_NAMES = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
_READ_SIZE = 1 << 20
_UTF8_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def _compression(url: str) -> str | None:
    for suffix, name in _COMPRESSION_NAMES.items():
        if url.lower().endswith(suffix):
            return name
    return None


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


def read_jsonl(file: CorpusFile, id_field: str, storage_options: dict | None,
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
    return record_from_obj(obj, id_field, derived, source, payload=text)


def _read_json_array(file: CorpusFile, id_field: str, data: bytes) -> Iterator[tuple[int, Record]]:
    try:
        items = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        source = f"{file.url}:1"
        yield 1, Record(f"{file.tag}-1", source, error=f"{source}: not a valid JSON array file "
                                                       f"({type(e).__name__}: {e}); fix it or write it as JSONL")
        return
    for i, obj in enumerate(items):
        yield i + 1, record_from_obj(obj, id_field, f"{file.tag}-{i + 1}", f"{file.url}:{i + 1}")


def count_lines(file: CorpusFile, storage_options: dict | None = None) -> int:
    """Lines in a JSONL file (decompressed), the last one counted without its newline: an upper bound on records."""
    n, last = 0, b"\n"
    with fsspec.open(file.url, "rb", compression="infer", **(storage_options or {})) as f:
        while chunk := f.read(1 << 22):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")
