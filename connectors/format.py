"""The hidden-states file format's names and the producer spec: what a file holds, without torch.

A file holds
    token_ids      int64 [T]
    hidden_states  model dtype [T, L, H]     rows follow the layer ids in the metadata, in the user's order
    loss_mask      uint8 [T]                 optional: 1 where a trainer should learn
plus, for an image prompt (a vision-language target, extractor.multimodal),
    mm_token_type_ids     uint8 [T]          0 text, 1 image (the processor's marks)
    position_ids          int64 [T, 3]       the M-RoPE positions each token was rotated by
    mm_embeds             dtype [N, H]       optional: the merged input embeddings at the N image tokens
plus, in a run with a top-k target (`--target top_k:K`: the last layer N replaced by what a trainer reads of it),
    target_topk_ids       int32 [T, K]       the target's K most likely next tokens after token t, best first
    target_topk_logprobs  float32 [T, K]     their log-probabilities (log_softmax of lm_head(final_norm(layer N)))
and a `__metadata__` (str -> str) built from `HiddenStatesSpec` plus per-request keys, among them
`"checksum": "xxh3_64:<16 hex digits>"`, the xxh3_64 of every byte after the header (the tensors' data, in file
order). Files written by vLLM have the two tensors and no metadata; they load all the same (with nothing to verify).

    TOKEN_IDS, HIDDEN_STATES, ...     the tensors' names; FORMAT_NAME / FORMAT_VERSION, LAYER_ID_CONVENTION
    HiddenStatesSpec                  what every file of one producer shares (its `__metadata__`)
    HiddenStatesFileError             the one error for a file hsx refuses: malformed header, damaged data, ...
    LayerIds / check_layer_ids        hidden-state ids, checked once where they enter
    check_target / target_top_k       the target: the states, or "top_k:K"
    MODEL, FP8, STORAGE_DTYPES        storage dtypes by name; check_storage_dtype, stored_dtype, is_scaled
    data_hasher / data_checksum       the data checksum (checked against a header by `connectors.header`)

The header itself (encoding, sizes, parsing and checking it, TensorEntry / HiddenStatesFileInfo) is
`connectors.header`; storing states in a storage dtype (quantize / dequantize) is `connectors.quant`. This module
imports no torch: run.json (`connectors.run`) and the command line read specs and names without it. The spec's
`torch_dtype` / `stored_torch_dtype` import torch when asked for a dtype object.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import torch

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
MM_TOKEN_TYPE_IDS = "mm_token_type_ids"
"""uint8 [T] (an image prompt's file): 0 text, 1 image, as the model's processor marks its tokens."""
POSITION_IDS = "position_ids"
"""int64 [T, S] (an image prompt's file on an M-RoPE target, S = 3 streams): the positions the target rotated each
token by; output tokens continue every stream from the prompt's largest + 1."""
MM_EMBEDS = "mm_embeds"
"""model dtype [N, H] (with the connector's mm_embeds setting): the merged input embeddings at the N image tokens
(the vision tower's output; N = the count of mm_token_type_ids == 1), what vLLM's EAGLE proposer feeds the drafter
there."""
PROMPT_ROW_FILL = {MM_TOKEN_TYPE_IDS: "zeros", POSITION_IDS: "continue"}
"""How a per-prompt-token tensor the engine hands the connector extends over output tokens (include_output_tokens):
zeros (text), or positions continuing after the prompt's largest."""
TARGET_STATES = ""
"""The default target: the listed layers' states, the last layer N among them when listed."""
TOP_K_PREFIX = "top_k:"
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

CHECKSUM_KEY = "checksum"
CHECKSUM_ALGORITHM = "xxh3_64"
CHECKSUM_PLACEHOLDER = f"{CHECKSUM_ALGORITHM}:{'0' * 16}"
"""What `request_metadata` puts under CHECKSUM_KEY: as long as every real value, so a file's size is known before
its data is hashed; the writer (`connectors.safetensors_file.write_atomic`) replaces it with the real one."""


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
    """How hidden_states are stored when not in `dtype` (STORAGE_DTYPES: bfloat16, float16, float32, or
    float8_e4m3fn with hidden_states_scales); "" = in `dtype`, the model's. Readers give back `dtype`. "" is the
    files' and run.json's spelling of the model dtype (absent in older files); settings spell it "model" (MODEL),
    and this spec is the one place that turns one into the other."""
    target: str = TARGET_STATES
    """What stands for the last layer N: "" = nothing but the listed layers (N among them when listed), or
    "top_k:K" = files carry target_topk_ids / target_topk_logprobs [T, K] from layer N through the final norm and
    lm_head, and N is not among `layer_ids` (EAGLE-3 reads no more of it)."""

    def __post_init__(self) -> None:
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

    def file_problem(self, info) -> str | None:
        """How the file whose header is `info` (a `connectors.header.HiddenStatesFileInfo`) differs from this spec
        (its recorded spec, then the shape and dtype of its hidden_states), or None when it is one of this producer's
        files. A file without hsx metadata (vLLM's) is compared by shape and dtype alone. What `hsx verify` and the
        training feed both check."""
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
        import torch  # the dtype object: callers that hold tensors have torch loaded already

        return getattr(torch, self.storage_dtype) if self.storage_dtype else self.torch_dtype

    @property
    def scaled(self) -> bool:
        """Whether the files carry hidden_states_scales (fp8)."""
        return is_scaled(self.storage_dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # as stored_torch_dtype

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


# -- storage dtypes -----------------------------------------------------------------------------------------------

FP8 = "float8_e4m3fn"
MODEL = "model"
"""The storage dtype that means: the model dtype the spec records (hsx's default, vLLM's files)."""
STORAGE_DTYPES = (MODEL, "float32", "bfloat16", "float16", FP8)
_ALIASES = {"fp8": FP8, "float8": FP8, "e4m3": FP8, "float8_e4m3": FP8, "bf16": "bfloat16", "fp16": "float16",
            "fp32": "float32", "auto": MODEL}


def check_storage_dtype(name: object, *, flag: str = "storage_dtype") -> str:
    """The canonical storage dtype for `name` (aliases: fp8, bf16, fp16, fp32; auto = model)."""
    text = str(name or MODEL).removeprefix("torch.")
    text = _ALIASES.get(text, text)
    if text not in STORAGE_DTYPES:
        raise ValueError(f"{flag} {name!r} is not a storage dtype; use one of {', '.join(STORAGE_DTYPES)} ({MODEL} = "
                         "the model's dtype; fp8 = float8_e4m3fn with a float32 scale per token and layer)")
    return text


def stored_dtype(storage_dtype: str, model_dtype: str) -> str:
    """The dtype name of the stored hidden_states tensor."""
    return model_dtype if storage_dtype in (MODEL, "") else storage_dtype


def is_scaled(storage_dtype: str) -> bool:
    """Whether files of this storage dtype carry `hidden_states_scales`."""
    return storage_dtype == FP8


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
