"""The hidden-states file format: safetensors, interchangeable with vLLM's, plus a self-describing header.

A file holds
    token_ids      int64 [T]
    hidden_states  model dtype [T, L, H]     rows follow the layer ids in the metadata, in the user's order
    loss_mask      uint8 [T]                 optional: 1 where a trainer should learn
and a `__metadata__` (str -> str) built from `HiddenStatesSpec` plus per-request keys. Files written by vLLM have
the two tensors and no metadata; they load all the same.

The header is parsed here without safetensors' `safe_open` (which needs a local path), so that a token range of a
remote file costs one header read and one byte-range read per tensor.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

FORMAT_NAME = "hsx.hidden_states"
FORMAT_VERSION = "1"
TOKEN_IDS = "token_ids"
HIDDEN_STATES = "hidden_states"
LOSS_MASK = "loss_mask"

# vLLM's convention: 0 = embeddings, k = output of decoder layer k-1 (residual stream), N = last layer pre-norm.
LAYER_ID_CONVENTION = "vllm"

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


@dataclass(frozen=True)
class HiddenStatesSpec:
    """What every file from one producer shares; written into each file's `__metadata__`."""

    layer_ids: tuple[int, ...]
    """Hidden-state ids in vLLM's convention (see LAYER_ID_CONVENTION), in the order rows are stored."""
    num_hidden_layers: int
    """N, the target model's decoder layer count; id N is the last layer's output."""
    hidden_size: int
    """H, the width of every stored row."""
    dtype: str
    """torch dtype name of `hidden_states`, e.g. "bfloat16"."""
    model: str = ""
    """The target model: a local path or hub id."""
    model_revision: str = ""
    """The model's revision or commit, when known."""
    last_layer_normalized: bool = False
    """Whether id N was stored after the model's final norm (hsx stores it pre-norm, as vLLM does)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Further producer facts (architecture, template, ...) copied into every file."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", check_layer_ids(self.layer_ids, self.num_hidden_layers))

    def to_metadata(self) -> dict[str, str]:
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "layer_ids": json.dumps(list(self.layer_ids)),
            "layer_id_convention": LAYER_ID_CONVENTION,
            "num_hidden_layers": str(self.num_hidden_layers),
            "hidden_size": str(self.hidden_size),
            "dtype": self.dtype,
            "last_layer_normalized": "true" if self.last_layer_normalized else "false",
            "model": self.model,
            "model_revision": self.model_revision,
        }
        meta.update({k: str(v) for k, v in self.extra.items()})
        return meta

    @classmethod
    def from_metadata(cls, metadata: dict[str, str], *, hidden_size: int | None = None,
                      dtype: str | None = None) -> HiddenStatesSpec | None:
        """The spec recorded in a file's `__metadata__` (the inverse of `to_metadata`); None for files without hsx
        metadata (vLLM's). `hidden_size` / `dtype` (from the tensor itself) fill keys the metadata lacks."""
        if metadata.get("format") != FORMAT_NAME:
            return None
        try:
            return cls(layer_ids=tuple(json.loads(metadata["layer_ids"])),
                       num_hidden_layers=int(metadata["num_hidden_layers"]),
                       hidden_size=int(metadata.get("hidden_size") or hidden_size or 0),
                       dtype=metadata.get("dtype") or dtype or "",
                       model=metadata.get("model", ""), model_revision=metadata.get("model_revision", ""),
                       last_layer_normalized=metadata.get("last_layer_normalized") == "true",
                       extra={k: metadata[k] for k in PRODUCER_KEYS if k in metadata})
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"the file's hsx metadata is unreadable ({type(e).__name__}: {e}); the file is corrupt "
                             "or was edited") from e

    def differences(self, other: HiddenStatesSpec) -> dict[str, tuple]:
        """{field: (self's value, other's value)} over what makes two files' states interchangeable."""
        return {f: (getattr(self, f), getattr(other, f)) for f in COMPARED_FIELDS
                if getattr(self, f) != getattr(other, f)}

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"dtype {self.dtype!r} is not a torch dtype name; use e.g. 'bfloat16'")
        return dt


# Fields two producers must share for their files to mix in one dataset.
COMPARED_FIELDS = ("layer_ids", "num_hidden_layers", "hidden_size", "dtype", "model", "last_layer_normalized")
# `extra` keys a producer writes (copied back by from_metadata); the rest of the metadata is per request.
PRODUCER_KEYS = ("architecture",)


def check_layer_ids(layer_ids, num_hidden_layers: int | None = None, *, name: str = "layer ids",
                    defer_range: bool = False) -> tuple[int, ...]:
    """The one check of hidden-state ids, used by the job's flags, the engine and the file spec.

    Accepts a sequence of ints or a comma-separated string ("2,16,29,32"); returns the ids as a tuple, in order.
    Raises ValueError naming `name` (e.g. "--layers") for non-integers, an empty list, duplicates, and ids outside
    0..N when `num_hidden_layers` (N) is known; when it is not, negative ids, unless `defer_range` (the caller checks
    the range once N is known, with the full message).
    """
    items = layer_ids.split(",") if isinstance(layer_ids, str) else list(layer_ids)
    ids: list[int] = []
    for item in items:
        if isinstance(item, str):
            if not item.strip():
                continue
            try:
                item = int(item.strip())
            except ValueError:
                raise ValueError(f"{name} {layer_ids!r} must be comma-separated integers, e.g. 2,16,29,32") from None
        if not isinstance(item, int) or isinstance(item, bool):
            raise ValueError(f"{name} must be integers, got {list(items)}")
        ids.append(int(item))
    if not ids:
        raise ValueError(f"{name} is empty; give hidden-state ids such as 2,16,29,32 (or leave them out for the "
                         "EAGLE-3 default)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} {ids} has duplicates; list each id once")
    if num_hidden_layers is None:
        if any(i < 0 for i in ids) and not defer_range:
            raise ValueError(f"{name} {ids} has negative ids; ids run from 0 (embeddings) to N (last layer)")
    else:
        bad = [i for i in ids if not 0 <= i <= num_hidden_layers]
        if bad:
            raise ValueError(f"{name} {ids}: ids {bad} are out of range for a model with {num_hidden_layers} decoder "
                             f"layers; valid ids are 0..{num_hidden_layers} (0 = embeddings, k = output of decoder "
                             f"layer k-1, {num_hidden_layers} = last layer, pre-norm)")
    return tuple(ids)


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
    def has_hsx_metadata(self) -> bool:
        return self.metadata.get("format") == FORMAT_NAME


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
    return metadata


def file_entries(spec: HiddenStatesSpec, num_tokens: int, *, loss_mask: bool) -> dict[str, tuple[torch.dtype, tuple]]:
    """name -> (dtype, shape) of the tensors of a file of `num_tokens` rows, in the order the connector writes them."""
    entries = {TOKEN_IDS: (torch.int64, (num_tokens,)),
               HIDDEN_STATES: (spec.torch_dtype, (num_tokens, len(spec.layer_ids), spec.hidden_size))}
    if loss_mask:
        entries[LOSS_MASK] = (torch.uint8, (num_tokens,))
    return entries


def file_size(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None) -> int:
    """Exact bytes of the file `encode_header` + the tensors' data make (what the connector writes)."""
    return len(encode_header(tensors, metadata)) + sum(dtype.itemsize * math.prod(shape)
                                                       for dtype, shape in tensors.values())


def parse_header(path: str, probe: bytes, total_size: int) -> tuple[HiddenStatesFileInfo, int]:
    """Parse a safetensors header from the first bytes of a file.

    Returns the info and the header's full length (8 + N); when the probe was too short to hold the whole header
    the caller reads `[0, header_len)` and calls again.
    """
    if len(probe) < 8:
        raise ValueError(f"{path}: {total_size} bytes is too short for a safetensors file (need at least 8)")
    (n,) = struct.unpack("<Q", probe[:8])
    header_len = 8 + n
    if n > 100_000_000 or header_len > total_size:
        raise ValueError(f"{path}: header length {n} does not fit a file of {total_size} bytes; "
                         "the file is not safetensors or is truncated")
    if len(probe) < header_len:
        return None, header_len  # type: ignore[return-value]
    try:
        header = json.loads(probe[8:header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: safetensors header is not valid JSON ({e}); the file is corrupt") from e
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorEntry] = {}
    for name, desc in header.items():
        if desc["dtype"] not in _ST_TO_TORCH:
            raise ValueError(f"{path}: tensor {name!r} has dtype {desc['dtype']}, which hsx cannot read")
        b, e = desc["data_offsets"]
        tensors[name] = TensorEntry(name, _ST_TO_TORCH[desc["dtype"]], tuple(desc["shape"]), header_len + b, header_len + e)
        if header_len + e > total_size:
            raise ValueError(f"{path}: tensor {name!r} ends at byte {header_len + e} but the file has {total_size} "
                             "bytes; the file is truncated")
    for required in (TOKEN_IDS, HIDDEN_STATES):
        if required not in tensors:
            raise ValueError(f"{path}: no {required!r} tensor (found {sorted(tensors)}); not a hidden-states file")
    hs = tensors[HIDDEN_STATES]
    if len(hs.shape) != 3 or tensors[TOKEN_IDS].shape != (hs.shape[0],):
        raise ValueError(f"{path}: expected hidden_states [T, L, H] and token_ids [T], found "
                         f"{list(hs.shape)} and {list(tensors[TOKEN_IDS].shape)}")
    return HiddenStatesFileInfo(path, tensors, dict(metadata), total_size), header_len


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
    return info, probe


def tensor_from_bytes(buf: bytes | bytearray, entry: TensorEntry, rows: int) -> torch.Tensor:
    """Decode `rows` leading rows of `entry` from raw little-endian bytes (a bytearray is used in place, no copy)."""
    shape = (rows, *entry.shape[1:])
    if rows == 0 or len(buf) == 0:
        return torch.empty(shape, dtype=entry.dtype)
    return torch.frombuffer(buf if isinstance(buf, bytearray) else bytearray(buf), dtype=entry.dtype).reshape(shape)
