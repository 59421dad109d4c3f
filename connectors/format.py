"""The hidden-states file format: safetensors, interchangeable with vLLM's, plus a self-describing header.

A file holds
    token_ids      int64 [T]
    hidden_states  model dtype [T, L, H]     rows follow the layer ids in the metadata, in the user's order
    loss_mask      uint8 [T]                 optional: 1 where a trainer should learn
plus, in a run with a top-k target (`--target top_k:K`: the last layer N replaced by what a trainer reads of it),
    target_topk_ids       int32 [T, K]       the target's K most likely next tokens after token t, best first
    target_topk_logprobs  float32 [T, K]     their log-probabilities (log_softmax of lm_head(final_norm(layer N)))
and a `__metadata__` (str -> str) built from `HiddenStatesSpec` plus per-request keys, among them
`"checksum": "xxh3_64:<16 hex digits>"`, the xxh3_64 of every byte after the header (the tensors' data, in file
order). Files written by vLLM have the two tensors and no metadata; they load all the same (with nothing to verify).

    HiddenStatesSpec                  what every file of one producer shares (its `__metadata__`)
    HiddenStatesFileError             the one error for a file hsx refuses: malformed header, damaged data, ...
    encode_header / file_size         the bytes before the data, and a file's exact size, before writing it
    data_bytes                        the tensors' data alone (a file's size less its header)
    file_entries / extra_row_entries  the tensors of a spec's files; the per-token ones beyond the states
    parse_header / read_header        a header, checked against the file's real size before any data is read
    data_hasher / check_checksum      the data checksum, written by `connectors.storage`, verified by readers

The header is parsed here without safetensors' `safe_open` (which needs a local path), so that a token range of a
remote file costs one header read and one byte-range read per tensor. Nothing in a header is trusted: dtypes,
shapes and offsets must describe tensors that tile the data region exactly (as safetensors requires), every size
is checked against the file's real size, and metadata must be str -> str; anything else is a HiddenStatesFileError.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import xxhash

FORMAT_NAME = "hsx.hidden_states"
FORMAT_VERSION = "1"
TOKEN_IDS = "token_ids"
HIDDEN_STATES = "hidden_states"
LOSS_MASK = "loss_mask"
HIDDEN_STATES_SCALES = "hidden_states_scales"
"""float32 [T, L, 1] (hsx: per token and layer) or [T, 1, 1] (speculators: per token), beside fp8 hidden_states."""
TARGET_TOPK_IDS = "target_topk_ids"
"""int32 [T, K]: the K most likely next tokens after token t (a top-k target run), best first."""
TARGET_TOPK_LOGPROBS = "target_topk_logprobs"
"""float32 [T, K]: their log-probabilities under the target (a top-k target run)."""
TARGET_STATES = ""
"""The default target: the listed layers' states, the last layer N among them when listed."""
TOP_K_PREFIX = "top_k:"
TOPK_IDS_DTYPE = torch.int32
TOPK_LOGPROBS_DTYPE = torch.float32
MAX_TOP_K = 4096
"""Largest K a top-k target takes (past a few hundred the file is no smaller than the layer it replaces)."""


def check_target(value: object, *, flag: str = "target") -> str:
    """The canonical target for `value`: "" (the states; also "states") or "top_k:K" with 1 <= K <= MAX_TOP_K."""
    text = "" if value is None else str(value).strip()
    if text in ("", "states"):
        return TARGET_STATES
    k = text.removeprefix(TOP_K_PREFIX) if text.startswith(TOP_K_PREFIX) else None
    if k is None or not k.isdigit() or not 1 <= int(k) <= MAX_TOP_K:
        raise ValueError(f"{flag} {value!r} is not a target; use 'states' (the default: the listed layers' hidden "
                         f"states) or 'top_k:K' with 1 <= K <= {MAX_TOP_K} (e.g. top_k:64: the target's top-64 "
                         "next-token log-probabilities stored in place of the last layer, for EAGLE-3)")
    return f"{TOP_K_PREFIX}{int(k)}"


def target_top_k(target: str) -> int | None:
    """K of a "top_k:K" target; None for the states target."""
    return int(target.removeprefix(TOP_K_PREFIX)) if target.startswith(TOP_K_PREFIX) else None

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
# Longest header accepted (safetensors' own limit); ours are a few hundred bytes.
MAX_HEADER_BYTES = 100_000_000

CHECKSUM_KEY = "checksum"
CHECKSUM_ALGORITHM = "xxh3_64"
CHECKSUM_PLACEHOLDER = f"{CHECKSUM_ALGORITHM}:{'0' * 16}"
"""What `request_metadata` puts under CHECKSUM_KEY: as long as every real value, so a file's size is known before
its data is hashed; the writer (`connectors.safetensors_file.write_atomic`) replaces it with the real one."""
_CHECKSUM_RE = re.compile(rf"{CHECKSUM_ALGORITHM}:[0-9a-f]{{16}}")


class HiddenStatesFileError(ValueError):
    """A file hsx refuses to read: not a regular file, a malformed or inconsistent header, truncated or damaged data
    (checksum mismatch), non-finite values. The message names the file, the problem and what to do; `path` and
    `reason` hold its two parts. A ValueError, so callers that catch ValueError keep working."""

    def __init__(self, path: str, reason: str | None = None) -> None:
        # one argument is a whole message: how pickle and torch's DataLoader (`exc_type(msg)`) rebuild an error
        super().__init__(path if reason is None else f"{path}: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self):
        return type(self), (self.path, self.reason)


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
    storage_dtype: str = ""
    """How hidden_states are stored when not in `dtype` (connectors.quant: bfloat16, float16, float32, or
    float8_e4m3fn with hidden_states_scales); "" = in `dtype`, the model's. Readers give back `dtype`."""
    target: str = TARGET_STATES
    """What stands for the last layer N: "" = nothing but the listed layers (N among them when listed), or
    "top_k:K" = files carry target_topk_ids / target_topk_logprobs [T, K] from layer N through the final norm and
    lm_head, and N is not among `layer_ids` (EAGLE-3 reads no more of it)."""

    def __post_init__(self) -> None:
        from connectors.quant import MODEL, check_storage_dtype

        object.__setattr__(self, "layer_ids", check_layer_ids(self.layer_ids, self.num_hidden_layers))
        storage = check_storage_dtype(self.storage_dtype or MODEL)
        object.__setattr__(self, "storage_dtype", "" if storage in (MODEL, self.dtype) else storage)
        object.__setattr__(self, "target", check_target(self.target))
        if self.top_k is not None and self.num_hidden_layers in self.layer_ids:
            raise ValueError(f"a {self.target} target stands for layer {self.num_hidden_layers} (the last), so it is "
                             f"not also stored; layer ids {list(self.layer_ids)} list it")

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
        if self.storage_dtype:  # written only when it differs: files in the model dtype stay as they were
            meta["storage_dtype"] = self.storage_dtype
        if self.target:  # likewise: files of the states target stay as they were
            meta["target"] = self.target
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
                       extra={k: metadata[k] for k in PRODUCER_KEYS if k in metadata},
                       storage_dtype=metadata.get("storage_dtype", ""), target=metadata.get("target", ""))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"the file's hsx metadata is unreadable ({type(e).__name__}: {e}); the file is corrupt "
                             "or was edited") from e

    def differences(self, other: HiddenStatesSpec) -> dict[str, tuple]:
        """{field: (self's value, other's value)} over what makes two files' states interchangeable."""
        return {f: (getattr(self, f), getattr(other, f)) for f in COMPARED_FIELDS
                if getattr(self, f) != getattr(other, f)}

    def file_problem(self, info: HiddenStatesFileInfo) -> str | None:
        """How the file whose header is `info` differs from this spec (its recorded spec, then the shape and dtype
        of its hidden_states), or None when it is one of this producer's files. A file without hsx metadata (vLLM's)
        is compared by shape and dtype alone. What `hsx verify` and the training feed both check."""
        theirs = info.spec
        if theirs is not None:
            diff = self.differences(theirs)
            if diff:
                return "its spec differs in " + "; ".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in diff.items())
        stored = self.stored_torch_dtype
        if (info.num_layers, info.hidden_size, info.dtype) != (len(self.layer_ids), self.hidden_size, stored):
            return (f"it stores hidden_states [T, {info.num_layers}, {info.hidden_size}] {info.dtype}, where the spec "
                    f"stores [T, {len(self.layer_ids)}, {self.hidden_size}] {stored}")
        if info.scaled != self.scaled:
            return f"it {'has' if info.scaled else 'lacks'} {HIDDEN_STATES_SCALES}, unlike the spec's files"
        if info.top_k != self.top_k:
            theirs_k = "no top-k target" if info.top_k is None else f"a top-{info.top_k} target"
            ours_k = "none" if self.top_k is None else f"top-{self.top_k}"
            return f"it holds {theirs_k}, where the spec's files hold {ours_k}"
        return None

    @property
    def top_k(self) -> int | None:
        """K of a top-k target run (files carry target_topk_ids / target_topk_logprobs [T, K]); None otherwise."""
        return target_top_k(self.target)

    @property
    def stored_torch_dtype(self) -> torch.dtype:
        """The dtype of the stored hidden_states tensor (`storage_dtype`, or `dtype`)."""
        return getattr(torch, self.storage_dtype) if self.storage_dtype else self.torch_dtype

    @property
    def scaled(self) -> bool:
        """Whether the files carry hidden_states_scales (fp8)."""
        from connectors.quant import is_scaled

        return is_scaled(self.storage_dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"dtype {self.dtype!r} is not a torch dtype name; use e.g. 'bfloat16'")
        return dt


# Fields two producers must share for their files to mix in one dataset.
COMPARED_FIELDS = ("layer_ids", "num_hidden_layers", "hidden_size", "dtype", "model", "last_layer_normalized",
                   "storage_dtype", "target")
# `extra` keys a producer writes (copied back by from_metadata); the rest of the metadata is per request.
PRODUCER_KEYS = ("architecture",)


class LayerIds(tuple):
    """Hidden-state ids that passed `check_layer_ids`: a tuple of ints (equal to the plain tuple), carried typed from
    the config boundary on, so the engine, the runner and the file spec take them without checking them again.
    `num_hidden_layers` is the N they were checked against (None: not yet against a model)."""

    num_hidden_layers: int | None

    def __new__(cls, ids, num_hidden_layers: int | None = None):
        self = super().__new__(cls, ids)
        self.num_hidden_layers = num_hidden_layers
        return self

    def __reduce__(self):  # pickles (Ray, DataLoader workers) with what it was checked against
        return LayerIds, (tuple(self), self.num_hidden_layers)


def check_layer_ids(layer_ids, num_hidden_layers: int | None = None, *, name: str = "layer ids",
                    defer_range: bool = False) -> LayerIds:
    """The one check of hidden-state ids, done where they enter (the flags, the engine's API, a file's metadata).

    Accepts a sequence of ints or a comma-separated string ("2,16,29,32"); returns them as `LayerIds`, in order.
    Raises ValueError naming `name` (e.g. "--layers") for non-integers, an empty list, duplicates, and ids outside
    0..N when `num_hidden_layers` (N) is known; when it is not, negative ids, unless `defer_range` (the caller checks
    the range once N is known, with the full message). Ids that already passed (a LayerIds checked against the same
    N, or any N when none is given now) are returned as they are.
    """
    if isinstance(layer_ids, LayerIds) and (
            layer_ids.num_hidden_layers == num_hidden_layers if num_hidden_layers is not None
            else layer_ids.num_hidden_layers is not None or defer_range or min(layer_ids) >= 0):
        return layer_ids
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
    return LayerIds(ids, num_hidden_layers)


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
    data_size = total_size - header_len
    tensors: dict[str, TensorEntry] = {}
    for name, desc in header.items():
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
        tensors[name] = TensorEntry(name, torch_dtype, tuple(shape), header_len + begin, header_len + end)
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
    for required in (TOKEN_IDS, HIDDEN_STATES):
        if required not in tensors:
            raise _bad(path, f"no {required!r} tensor (found {_short(sorted(tensors))})")
    hs, ids = tensors[HIDDEN_STATES].shape, tensors[TOKEN_IDS].shape
    if len(hs) != 3 or ids != (hs[0],):
        raise _bad(path, f"expected hidden_states [T, L, H] and token_ids [T], found {_short(list(hs))} and "
                         f"{_short(list(ids))}")
    if LOSS_MASK in tensors and tensors[LOSS_MASK].shape != (hs[0],):
        raise _bad(path, f"loss_mask has shape {_short(list(tensors[LOSS_MASK].shape))}, expected [{hs[0]}]")
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
    _check_metadata(path, metadata, tensors)
    return HiddenStatesFileInfo(path, tensors, dict(metadata), total_size)


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


# -- the data checksum ------------------------------------------------------------------------------------------


def data_hasher() -> xxhash.xxh3_64:
    """A fresh hash of a file's data region: `update` it with the bytes after the header, in file order."""
    return xxhash.xxh3_64()


def checksum_value(hasher: xxhash.xxh3_64) -> str:
    """The metadata value for a hash: "xxh3_64:<16 hex digits>"."""
    return f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}"


def data_checksum(buffers: Iterable[bytes | bytearray | memoryview]) -> str:
    """The checksum of data given as buffers in file order (the value `checksum_value` gives)."""
    hasher = data_hasher()
    for buf in buffers:
        hasher.update(buf)
    return checksum_value(hasher)


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
