"""A hidden-states file's header: built before the data is written, parsed and checked before any data is read.

    TensorEntry / HiddenStatesFileInfo    a tensor's dtype, shape and byte range; a file's header (tensors, metadata)
    encode_header / file_size             the bytes before the data, and a file's exact size, before writing it
    request_metadata                      a file's whole `__metadata__`: the spec's plus one request's keys
    data_bytes                            the tensors' data alone (a file's size less its header)
    file_entries / extra_row_entries      the tensors of a spec's files; the per-token ones beyond the states
    parse_header / read_header            a header, checked against the file's real size before any data is read
    check_checksum                        the data checksum (`connectors.format.data_checksum`) against the header's
    tensor_from_bytes                     a tensor from its raw bytes
    TOPK_IDS_DTYPE, TOPK_LOGPROBS_DTYPE   the top-k target tensors' dtypes

The header is parsed here without safetensors' `safe_open` (which needs a local path), so that a token range of a
remote file costs one header read and one byte-range read per tensor. Nothing in a header is trusted: dtypes,
shapes and offsets must describe tensors that tile the data region exactly (as safetensors requires), every size
is checked against the file's real size, and metadata must be str -> str; anything else is a HiddenStatesFileError.
The names a file holds and the producer spec are `connectors.format`'s.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from connectors.format import (
    CHECKSUM_ALGORITHM,
    CHECKSUM_KEY,
    CHECKSUM_PLACEHOLDER,
    FORMAT_NAME,
    HIDDEN_STATES,
    HIDDEN_STATES_SCALES,
    LOSS_MASK,
    MM_EMBEDS,
    MM_TOKEN_TYPE_IDS,
    POSITION_IDS,
    TARGET_TOPK_IDS,
    TARGET_TOPK_LOGPROBS,
    TOKEN_IDS,
    HiddenStatesFileError,
    HiddenStatesSpec,
)

TOPK_IDS_DTYPE = torch.int32
TOPK_LOGPROBS_DTYPE = torch.float32

_ST_TO_TORCH = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e4m3fn"):
    _ST_TO_TORCH["F8_E4M3"] = torch.float8_e4m3fn
    _ST_TO_TORCH["F8_E5M2"] = torch.float8_e5m2

_TORCH_TO_ST = {v: k for k, v in _ST_TO_TORCH.items()}

# First read of a file: enough for any header we write (a few hundred bytes) in one round trip.
HEADER_PROBE_BYTES = 64 * 1024
# Longest header accepted (safetensors' own limit); ours are a few hundred bytes.
MAX_HEADER_BYTES = 100_000_000

_CHECKSUM_RE = re.compile(rf"{CHECKSUM_ALGORITHM}:[0-9a-f]{{16}}")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset of the first data byte in the file."""
    end: int

    @property
    def row_bytes(self) -> int:
        """Bytes per index of the first dimension."""
        if not self.shape or self.shape[0] == 0:
            return 0
        return (self.end - self.start) // self.shape[0]


@dataclass(frozen=True)
class HiddenStatesFileInfo:
    """A file's header: its tensors and metadata, without the data."""

    path: str
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    size: int
    """Total file size in bytes."""

    @property
    def num_tokens(self) -> int:
        return self.tensors[HIDDEN_STATES].shape[0]

    @property
    def num_layers(self) -> int:
        return self.tensors[HIDDEN_STATES].shape[1]

    @property
    def hidden_size(self) -> int:
        return self.tensors[HIDDEN_STATES].shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[HIDDEN_STATES].dtype

    @property
    def layer_ids(self) -> tuple[int, ...] | None:
        """The stored hidden-state ids, or None for files without hsx metadata (e.g. written by vLLM)."""
        raw = self.metadata.get("layer_ids")
        return tuple(json.loads(raw)) if raw else None

    @property
    def spec(self) -> HiddenStatesSpec | None:
        """The producer spec recorded in the header (`HiddenStatesSpec.from_metadata`), or None for files without
        hsx metadata (vLLM's)."""
        return HiddenStatesSpec.from_metadata(self.metadata, hidden_size=self.hidden_size,
                                              dtype=str(self.dtype).removeprefix("torch."))

    @property
    def scaled(self) -> bool:
        """Whether hidden_states are stored scaled (fp8 with hidden_states_scales)."""
        return HIDDEN_STATES_SCALES in self.tensors

    @property
    def top_k(self) -> int | None:
        """K of the file's top-k target tensors ([T, K]), or None when it has none."""
        entry = self.tensors.get(TARGET_TOPK_IDS)
        return None if entry is None else entry.shape[1]

    @property
    def has_hsx_metadata(self) -> bool:
        return self.metadata.get("format") == FORMAT_NAME

    @property
    def checksum(self) -> str | None:
        """The recorded checksum of the data ("xxh3_64:<16 hex>"), or None for files without one (vLLM's)."""
        return self.metadata.get(CHECKSUM_KEY)

    @property
    def data_start(self) -> int:
        """Absolute offset of the data region (the first byte after the header); the tensors tile it to the end."""
        return min(e.start for e in self.tensors.values())


def encode_header(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None) -> bytes:
    """The bytes before the data of a safetensors file whose tensors (name -> (dtype, shape)) follow back to back
    in this order: 8-byte little-endian length, JSON padded with spaces so the data starts 8-byte aligned.

    Writing the header ourselves lets the writer send the tensors' own memory after it, with no serialised copy.
    """
    header: dict = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        if dtype not in _TORCH_TO_ST:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store")
        nbytes = dtype.itemsize
        for dim in shape:
            nbytes *= dim
        header[name] = {"dtype": _TORCH_TO_ST[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    # raw UTF-8 and compact, as safetensors itself writes headers: the same bytes for the same file
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def request_metadata(spec_metadata: dict[str, str], *, request_id: str, num_tokens: int, num_prompt_tokens: int,
                     include_output_tokens: bool, sample_id: str | None = None) -> dict[str, str]:
    """A file's whole `__metadata__`: the producer's spec plus the keys of one request."""
    metadata = dict(spec_metadata)
    metadata.update(request_id=str(request_id), num_tokens=str(num_tokens), num_prompt_tokens=str(num_prompt_tokens),
                    include_output_tokens="true" if include_output_tokens else "false")
    if sample_id is not None:
        metadata["sample_id"] = str(sample_id)
    metadata[CHECKSUM_KEY] = CHECKSUM_PLACEHOLDER  # the writer fills it in, same length: file_size stays exact
    return metadata


def extra_row_entries(spec: HiddenStatesSpec) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape of one row) of the per-token tensors an engine hands the connector beside token_ids
    and hidden_states for files of `spec` (a top-k target's), in file order."""
    if spec.top_k is None:
        return {}
    return {TARGET_TOPK_IDS: (TOPK_IDS_DTYPE, (spec.top_k,)), TARGET_TOPK_LOGPROBS: (TOPK_LOGPROBS_DTYPE, (spec.top_k,))}


def file_entries(spec: HiddenStatesSpec, num_tokens: int, *, loss_mask: bool) -> dict[str, tuple[torch.dtype, tuple]]:
    """name -> (dtype, shape) of the tensors of a file of `num_tokens` rows, in the order the connector writes them."""
    entries = {TOKEN_IDS: (torch.int64, (num_tokens,)),
               HIDDEN_STATES: (spec.stored_torch_dtype, (num_tokens, len(spec.layer_ids), spec.hidden_size))}
    if spec.scaled:
        entries[HIDDEN_STATES_SCALES] = (torch.float32, (num_tokens, len(spec.layer_ids), 1))
    entries.update({name: (dtype, (num_tokens, *row)) for name, (dtype, row) in extra_row_entries(spec).items()})
    if loss_mask:
        entries[LOSS_MASK] = (torch.uint8, (num_tokens,))
    return entries


def file_size(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None) -> int:
    """Exact bytes of the file `encode_header` + the tensors' data make (what the connector writes).

    Exact for the file `connectors.safetensors_file.write_atomic` makes of `metadata` when that holds the checksum key (as
    `request_metadata` does, with CHECKSUM_PLACEHOLDER): the writer replaces the value with one of the same length.
    """
    return len(encode_header(tensors, metadata)) + data_bytes(tensors)


def data_bytes(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> int:
    """Bytes of the tensors' data alone (name -> (dtype, shape)), without the header."""
    return sum(dtype.itemsize * math.prod(shape) for dtype, shape in tensors.values())


def parse_header(path: str, probe: bytes, total_size: int) -> tuple[HiddenStatesFileInfo, int]:
    """Parse and check a safetensors header from the first bytes of a file of `total_size` bytes.

    Returns the info and the header's full length (8 + N); when the probe was too short to hold the whole header
    the caller reads `[0, header_len)` and calls again. Raises HiddenStatesFileError for anything but a header whose
    tensors tile the rest of the file exactly (see `_check_header`), before a single data byte is read.
    """
    if total_size < 8 or len(probe) < 8:
        raise HiddenStatesFileError(path, f"{total_size} bytes is too short for a safetensors file (need at least 8); "
                                          "the file is truncated or not safetensors: re-extract it")
    (n,) = struct.unpack("<Q", probe[:8])
    header_len = 8 + n
    if n > MAX_HEADER_BYTES or header_len > total_size:
        raise HiddenStatesFileError(path, f"header length {n} does not fit a file of {total_size} bytes (headers "
                                          f"are at most {MAX_HEADER_BYTES}); the file is not safetensors or is "
                                          "truncated: re-extract it")
    if len(probe) < header_len:
        return None, header_len  # type: ignore[return-value]
    header = _decode_json(path, probe[8:header_len], "safetensors header")
    return _check_header(path, header, header_len, total_size), header_len


def _bad(path: str, problem: str) -> HiddenStatesFileError:
    return HiddenStatesFileError(path, f"{problem}; the file is corrupt, truncated or not a hidden-states file: "
                                       "re-extract it (or drop it from the run)")


def _short(value: object, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: a hostile header can make a value of any size."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _decode_json(path: str, raw: bytes, what: str):
    def no_duplicates(pairs: list[tuple[str, object]]) -> dict:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise _bad(path, f"{what} names {_short(dup)} twice")
        return out

    try:
        return json.loads(raw, object_pairs_hook=no_duplicates)
    except HiddenStatesFileError:
        raise
    except RecursionError:
        raise _bad(path, f"{what} is nested too deeply to be a header") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, and ints too long to convert
        raise _bad(path, f"{what} is not valid JSON ({_short(str(e), 200)})") from e


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _nbytes(itemsize: int, shape: list[int], limit: int) -> int:
    """itemsize * prod(shape), or limit + 1 as soon as it exceeds `limit` (a hostile shape can have any size)."""
    if 0 in shape:
        return 0
    n = itemsize
    for dim in shape:
        n *= dim
        if n > limit:
            return limit + 1
    return n


def _check_header(path: str, header: object, header_len: int, total_size: int) -> HiddenStatesFileInfo:
    """The info of a decoded header, after checking everything a reader relies on:

    an object of objects; `__metadata__` str -> str; each tensor a known dtype, a shape of non-negative ints and
    data_offsets [begin, end] with end - begin = prod(shape) * itemsize; sorted by begin, the tensors tile the data
    region [0, total_size - header_len) exactly (no gap, no overlap, nothing after); token_ids [T], hidden_states
    [T, L, H] and loss_mask [T] agree; hsx metadata's layer_ids and num_tokens agree with the shapes.
    """
    if not isinstance(header, dict):
        raise _bad(path, f"safetensors header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad(path, f"__metadata__ must map strings to strings, got {_short(metadata)}")
    tensors = {name: _tensor_entry(path, name, desc, header_len, total_size) for name, desc in header.items()}
    _check_tiling(path, tensors, header_len, total_size)
    _check_shapes(path, tensors)
    _check_metadata(path, metadata, tensors)
    return HiddenStatesFileInfo(path, tensors, dict(metadata), total_size)


def _tensor_entry(path: str, name: str, desc: object, header_len: int, total_size: int) -> TensorEntry:
    """One tensor's header entry, checked on its own: a known dtype, a shape, data_offsets that fit the file and
    span exactly the tensor's bytes."""
    data_size = total_size - header_len
    if not isinstance(desc, dict):
        raise _bad(path, f"tensor {_short(name)} is described by a JSON {type(desc).__name__}, not an object")
    dtype, shape, offsets = desc.get("dtype"), desc.get("shape"), desc.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ST_TO_TORCH:
        raise _bad(path, f"tensor {_short(name)} has dtype {_short(dtype)}, which hsx cannot read (known: "
                         f"{', '.join(_ST_TO_TORCH)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _bad(path, f"tensor {_short(name)} has shape {_short(shape)}; a shape is a list of non-negative "
                         "integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise _bad(path, f"tensor {_short(name)} has data_offsets {_short(offsets)}; expected [begin, end] with "
                         "0 <= begin <= end")
    begin, end = offsets
    if end > data_size:
        raise _bad(path, f"tensor {_short(name)} ends at byte {header_len + end} but the file has {total_size} "
                         "bytes")
    torch_dtype = _ST_TO_TORCH[dtype]
    nbytes = _nbytes(torch_dtype.itemsize, shape, data_size)
    if nbytes != end - begin:
        size = "more than the file holds" if nbytes > data_size else f"{nbytes} bytes"
        raise _bad(path, f"tensor {_short(name)} {dtype} {_short(shape)} needs {size}, but its data_offsets "
                         f"{offsets} span {end - begin}")
    return TensorEntry(name, torch_dtype, tuple(shape), header_len + begin, header_len + end)


def _check_tiling(path: str, tensors: dict[str, TensorEntry], header_len: int, total_size: int) -> None:
    """Sorted by start, the tensors tile the data region exactly: no gap, no overlap, nothing after."""
    cursor = header_len
    for e in sorted(tensors.values(), key=lambda e: (e.start, e.end)):
        if e.start != cursor:
            problem = "overlaps the tensor before it" if e.start < cursor else f"leaves {e.start - cursor} bytes unused"
            raise _bad(path, f"tensor {_short(e.name)} starts at byte {e.start}, expected {cursor}: it {problem} "
                             "(safetensors tensors tile the data region)")
        cursor = e.end
    if cursor != total_size:
        raise _bad(path, f"the tensors end at byte {cursor} but the file has {total_size} bytes "
                         f"({total_size - cursor} unaccounted for)")


def _check_shapes(path: str, tensors: dict[str, TensorEntry]) -> None:
    """token_ids [T] and hidden_states [T, L, H] present; loss_mask, scales and top-k tensors shaped to agree."""
    for required in (TOKEN_IDS, HIDDEN_STATES):
        if required not in tensors:
            raise _bad(path, f"no {required!r} tensor (found {_short(sorted(tensors))})")
    hs, ids = tensors[HIDDEN_STATES].shape, tensors[TOKEN_IDS].shape
    if len(hs) != 3 or ids != (hs[0],):
        raise _bad(path, f"expected hidden_states [T, L, H] and token_ids [T], found {_short(list(hs))} and "
                         f"{_short(list(ids))}")
    if LOSS_MASK in tensors and tensors[LOSS_MASK].shape != (hs[0],):
        raise _bad(path, f"loss_mask has shape {_short(list(tensors[LOSS_MASK].shape))}, expected [{hs[0]}]")
    if MM_TOKEN_TYPE_IDS in tensors and tensors[MM_TOKEN_TYPE_IDS].shape != (hs[0],):
        raise _bad(path, f"mm_token_type_ids has shape {_short(list(tensors[MM_TOKEN_TYPE_IDS].shape))}, expected "
                         f"[{hs[0]}]")
    if MM_TOKEN_TYPE_IDS in tensors and POSITION_IDS in tensors and (len(tensors[POSITION_IDS].shape) != 2 or tensors[POSITION_IDS].shape[0] != hs[0]
                                    or tensors[POSITION_IDS].dtype.is_floating_point):
        raise _bad(path, f"position_ids is {tensors[POSITION_IDS].dtype} {_short(list(tensors[POSITION_IDS].shape))}, "
                         f"expected integers [{hs[0]}, streams]")
    if MM_EMBEDS in tensors and (len(tensors[MM_EMBEDS].shape) != 2 or tensors[MM_EMBEDS].shape[1] != hs[2]
                                 or MM_TOKEN_TYPE_IDS not in tensors):
        raise _bad(path, f"mm_embeds has shape {_short(list(tensors[MM_EMBEDS].shape))}; expected [N, {hs[2]}] beside "
                         "mm_token_type_ids")
    if HIDDEN_STATES_SCALES in tensors:
        scales = tensors[HIDDEN_STATES_SCALES]
        if scales.shape not in ((hs[0], hs[1], 1), (hs[0], 1, 1)) or not scales.dtype.is_floating_point:
            raise _bad(path, f"hidden_states_scales is {scales.dtype} {_short(list(scales.shape))}; expected float32 "
                             f"[{hs[0]}, {hs[1]}, 1] (per token and layer) or [{hs[0]}, 1, 1] (per token)")
        if tensors[HIDDEN_STATES].dtype.itemsize != 1:
            raise _bad(path, f"hidden_states_scales beside {tensors[HIDDEN_STATES].dtype} hidden_states; scales go "
                             "with fp8 states only")
    if TARGET_TOPK_IDS in tensors or TARGET_TOPK_LOGPROBS in tensors:
        ids_e, lp_e = tensors.get(TARGET_TOPK_IDS), tensors.get(TARGET_TOPK_LOGPROBS)
        if ids_e is None or lp_e is None:
            raise _bad(path, f"{TARGET_TOPK_IDS} and {TARGET_TOPK_LOGPROBS} come together; the file has one of them")
        k = ids_e.shape[1] if len(ids_e.shape) == 2 else -1
        if (ids_e.shape != (hs[0], k) or lp_e.shape != ids_e.shape or k < 1 or ids_e.dtype != TOPK_IDS_DTYPE
                or lp_e.dtype != TOPK_LOGPROBS_DTYPE):
            raise _bad(path, f"top-k target tensors are {ids_e.dtype} {_short(list(ids_e.shape))} and {lp_e.dtype} "
                             f"{_short(list(lp_e.shape))}; expected int32 and float32 [{hs[0]}, K], K >= 1")


def _check_metadata(path: str, metadata: dict[str, str], tensors: dict[str, TensorEntry]) -> None:
    """The metadata keys readers interpret must agree with the tensors they describe."""
    hidden = tensors[HIDDEN_STATES]
    t, num_layers, hidden_size = hidden.shape
    if "layer_ids" in metadata:
        ids = _decode_json(path, metadata["layer_ids"].encode(), "metadata 'layer_ids'")
        if not isinstance(ids, list) or not all(_is_int(i) for i in ids) or len(ids) != num_layers:
            raise _bad(path, f"metadata layer_ids {_short(metadata['layer_ids'])} must list {num_layers} integer "
                             f"ids, one per stored layer of hidden_states {list(hidden.shape)}")
    if metadata.get("format") == FORMAT_NAME:
        try:
            spec = HiddenStatesSpec.from_metadata(metadata, hidden_size=hidden_size,
                                                dtype=str(hidden.dtype).removeprefix("torch."))
            stored = (spec.hidden_size, spec.stored_torch_dtype)
        except ValueError as e:
            raise _bad(path, str(e)) from e
        if stored != (hidden_size, hidden.dtype):
            raise _bad(path, f"metadata says hidden_size {stored[0]} and dtype {stored[1]}, but hidden_states is "
                             f"{list(hidden.shape)} {hidden.dtype}")
        if "num_tokens" in metadata and metadata["num_tokens"] != str(t):
            raise _bad(path, f"metadata says num_tokens {_short(metadata['num_tokens'])} but hidden_states holds {t} "
                             "rows")
        k = tensors[TARGET_TOPK_IDS].shape[1] if TARGET_TOPK_IDS in tensors else None
        if spec.top_k != k:
            raise _bad(path, f"metadata says target {spec.target or 'states'!r} but the file holds "
                             f"{'no top-k tensors' if k is None else f'top-{k} tensors'}")
    checksum = metadata.get(CHECKSUM_KEY)
    if checksum is not None and checksum.startswith(f"{CHECKSUM_ALGORITHM}:") and not _CHECKSUM_RE.fullmatch(checksum):
        raise _bad(path, f"metadata checksum {_short(checksum)} is malformed; expected "
                         f"'{CHECKSUM_ALGORITHM}:<16 lowercase hex digits>'")


def read_header(path: str, size: int | Callable[[], int],
                read_range: Callable[[int, int], bytes]) -> tuple[HiddenStatesFileInfo, bytes]:
    """Parse a file's header through `read_range(start, end)`: one probe read, a second only for a huge header.

    `size` is the file size, or a function asked for it only when the probe does not show it (a probe shorter than
    asked for is the whole file: no size request for small remote files). Returns the info and the probe (the
    file's first min(size, HEADER_PROBE_BYTES) bytes).
    """
    if callable(size):
        probe = read_range(0, HEADER_PROBE_BYTES)
        size = len(probe) if len(probe) < HEADER_PROBE_BYTES else size()
    else:
        probe = read_range(0, min(size, HEADER_PROBE_BYTES))
    info, header_len = parse_header(path, probe, size)
    if info is None:
        info, _ = parse_header(path, read_range(0, header_len), size)
        if info is None:
            raise HiddenStatesFileError(path, f"the file ended before its {header_len}-byte header did; it is "
                                              "truncated (or was replaced while being read): re-extract it")
    return info, probe


def tensor_from_bytes(buf: bytes | bytearray, entry: TensorEntry, rows: int | None = None) -> torch.Tensor:
    """Decode `rows` leading rows of `entry` (the whole tensor when None) from raw little-endian bytes, which must be
    exactly that long (a bytearray is used in place, no copy)."""
    shape = entry.shape if rows is None else (rows, *entry.shape[1:])
    nbytes = entry.dtype.itemsize * math.prod(shape)
    if len(buf) != nbytes:
        raise ValueError(f"{len(buf)} bytes cannot hold tensor {entry.name!r} {list(shape)} {entry.dtype} "
                         f"({nbytes} bytes); the read came back short")
    if nbytes == 0:
        return torch.empty(shape, dtype=entry.dtype)
    return torch.frombuffer(buf if isinstance(buf, bytearray) else bytearray(buf), dtype=entry.dtype).reshape(shape)


def check_checksum(info: HiddenStatesFileInfo, actual: str) -> None:
    """Raise HiddenStatesFileError unless `actual` (the checksum of the file's data) is the recorded one.

    Files without a checksum (vLLM's, hsx's from before checksums) have nothing to check and pass.
    """
    expected = info.checksum
    if expected is None:
        return
    if not expected.startswith(f"{CHECKSUM_ALGORITHM}:"):
        raise HiddenStatesFileError(info.path, f"its checksum {_short(expected)} uses an algorithm this hsx does not "
                                               f"know (it knows {CHECKSUM_ALGORITHM}); upgrade hsx, or read without "
                                               "verification (verify=False)")
    if actual != expected:
        raise HiddenStatesFileError(info.path, f"checksum mismatch: the data hashes to {actual}, the header records "
                                               f"{expected}; the file is damaged: re-extract it")
