"""The training feed: a torch Dataset over an extraction run, opened from its manifest alone.

    HiddenStatesDataset(output, ...)   one item per "ok" sample of a run (or of several runs with the same spec):
                                         raw:    input_ids [T], loss_mask [T], hidden_states [T, L, H]
                                         eagle3: input_ids [T], loss_mask [T],
                                                 aux_hidden_states [T, (L-1)*H], target_hidden_states [T, H]
    HiddenStatesDatasetConfig          what an item holds: layout, final norm, truncation, local cache
    RunInfo / read_run_info(output)    what every file of a run shares (layers, dtype, model, norm status)
    FinalNorm.from_model_dir(dir)      the target model's final norm, loaded from its safetensors checkpoint alone
    ShardSampler                       distributed: each rank a disjoint share, all ranks together every sample once

A run is the folder (or URL) an extraction job writes:
    OUTPUT/run.json        the run's spec (model, layer ids and convention, dtype, hidden size, ...)
    OUTPUT/manifest/       Parquet, one row per sample: sample_id, path (relative to OUTPUT), num_tokens,
                           num_prompt_tokens, status ("ok"/"failed"), error, bytes
    OUTPUT/<sub>/...       the hidden-states files (see format.py)

Opening reads run.json and the manifest, never the data files (a run.json that lacks a spec key costs one header
read of the first file). Only "ok" rows count; a sample listed "ok" more than once (resumes) is kept once. Items are
read with one small request for a small file (header and data together), or header + byte ranges for a large one,
so `max_length` fetches only the leading tokens. The filesystem is opened lazily in each process, so the dataset
pickles into DataLoader workers (fork or spawn).

Every file is checked against the run's spec when it is read: a file from another model, other layers or another
dtype fails loudly instead of training on a mixed run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import mmap
import os
import posixpath
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, Sampler

from connectors import storage
from connectors.format import (
    HIDDEN_STATES,
    LAYER_ID_CONVENTION,
    LOSS_MASK,
    TOKEN_IDS,
    HiddenStatesFileInfo,
    read_header,
    tensor_from_bytes,
)

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
MANIFEST_DIR = "manifest"
MANIFEST_COLUMNS = ("sample_id", "path", "num_tokens", "status")
STATUS_OK = "ok"
LAYOUTS = ("raw", "eagle3")

# model_type -> how its final norm computes. "rms": weight * (x * rsqrt(mean(x^2) + eps)) in float32, cast back
# before the weight (Llama/Qwen/Mistral style). Gemma-style (1 + weight) norms are deliberately absent.
_NORM_KINDS = {
    "llama": "rms", "mistral": "rms", "mixtral": "rms", "qwen2": "rms", "qwen2_moe": "rms", "qwen3": "rms",
    "qwen3_moe": "rms", "gpt2": "layer",
}
_NORM_KEYS = {
    "rms": ("model.norm.weight", "norm.weight", "model.language_model.norm.weight"),
    "layer": ("transformer.ln_f.weight", "ln_f.weight"),
}


# -- the run's spec ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunInfo:
    """What every file of a run shares. Two runs can be read as one dataset only when these agree."""

    layer_ids: tuple[int, ...]
    """Stored hidden-state ids, in row order, in `layer_id_convention` (vLLM's: 0 = embeddings, N = last layer)."""
    num_hidden_layers: int
    """N, the target model's decoder layer count."""
    hidden_size: int
    """H, the width of every stored row."""
    dtype: str
    """torch dtype name of the stored hidden states, e.g. "bfloat16"."""
    model: str = ""
    """The target model (local path or hub id) as the run recorded it."""
    last_layer_normalized: bool = False
    """Whether id N was stored after the model's final norm (hsx and vLLM store it pre-norm)."""
    layer_id_convention: str = LAYER_ID_CONVENTION
    """How `layer_ids` count; hsx writes "vllm"."""

    _COMPARED = ("layer_ids", "num_hidden_layers", "hidden_size", "dtype", "model", "last_layer_normalized",
                 "layer_id_convention")

    def differences(self, other: RunInfo) -> dict[str, tuple[Any, Any]]:
        """{field: (self's value, other's value)} for every field that differs."""
        return {f: (getattr(self, f), getattr(other, f)) for f in self._COMPARED
                if getattr(self, f) != getattr(other, f)}

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"the run records dtype {self.dtype!r}, which is not a torch dtype")
        return dt


_SPEC_KEYS = ("layer_ids", "num_hidden_layers", "hidden_size", "dtype", "model", "last_layer_normalized",
              "layer_id_convention")
_ALIASES = {"layer_ids": ("layer_ids", "layers"), "model": ("model", "model_name", "model_path")}


def _parse_field(name: str, value: Any) -> Any:
    if name == "layer_ids":
        if isinstance(value, str):
            value = json.loads(value) if value.strip().startswith("[") else [int(v) for v in value.split(",")]
        return tuple(int(v) for v in value)
    if name in ("num_hidden_layers", "hidden_size"):
        return int(value)
    if name == "last_layer_normalized":
        return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes")
    if name == "dtype":
        return str(value).removeprefix("torch.")
    return str(value)


def _spec_fields(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """Pick the spec keys out of run.json (top level first, then one level of nesting) or a file's metadata."""
    scopes = [mapping] + [v for v in mapping.values() if isinstance(v, Mapping)]
    found: dict[str, Any] = {}
    for name in _SPEC_KEYS:
        for scope in scopes:
            key = next((k for k in _ALIASES.get(name, (name,))
                        if scope.get(k) not in (None, "") and not isinstance(scope.get(k), Mapping)), None)
            if key is not None:
                try:
                    found[name] = _parse_field(name, scope[key])
                except (ValueError, TypeError) as e:
                    raise ValueError(f"cannot parse {key}={scope[key]!r}: {e}") from e
                break
    return found


def _read_json(fs, path: str) -> dict[str, Any] | None:
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{storage.full_url(fs, path)} is not valid JSON ({e}); the run's spec is unreadable") from e


def _run_info(fs, root: str, first_file: str | None) -> RunInfo:
    """The run's spec from run.json; keys it lacks come from the first data file's header (one read)."""
    run_json = _read_json(fs, posixpath.join(root, RUN_FILE)) or {}
    fields = _spec_fields(run_json)
    required = ("layer_ids", "num_hidden_layers", "hidden_size", "dtype")
    # last_layer_normalized and the convention default to hsx's (pre-norm, vLLM ids); every file read checks them
    if not all(k in fields for k in (*required, "model")) and first_file is not None:
        header = _read_header(fs, first_file)
        from_file = _spec_fields(header.metadata)
        from_file.setdefault("hidden_size", header.hidden_size)
        from_file.setdefault("dtype", str(header.dtype).removeprefix("torch."))
        clash = {k: (fields[k], v) for k, v in from_file.items() if k in fields and fields[k] != v}
        if clash:
            raise ValueError(f"run.json of {storage.full_url(fs, root)} disagrees with its data file "
                             f"{storage.full_url(fs, first_file)} on {clash}; the run is mixed or run.json is stale")
        fields = {**from_file, **fields}
    missing = [k for k in required if k not in fields]
    if missing:
        raise ValueError(f"{storage.full_url(fs, root)}: cannot tell the run's {missing} — neither run.json nor the "
                         "first data file's metadata records them. Is this an hsx run? (files written by vLLM carry "
                         "no metadata; load them with load_hidden_states instead)")
    return RunInfo(**fields)


def read_run_info(output: str, *, storage_options: dict | None = None) -> RunInfo:
    """The spec of the run at `output` (run.json, else the header of its first "ok" file)."""
    fs, root = storage.open_url(output, storage_options)
    rows = _read_manifest(fs, root)
    first = posixpath.join(root, rows["path"][0].as_py()) if len(rows) else None
    return _run_info(fs, root, first)


# -- the manifest -----------------------------------------------------------------------------------------------


def _read_manifest(fs, root: str) -> pa.Table:
    """The run's "ok" rows, one per sample_id, sorted by sample_id: columns sample_id, path, num_tokens."""
    mdir = posixpath.join(root, MANIFEST_DIR)
    url = storage.full_url(fs, mdir)
    if not fs.exists(mdir):
        raise FileNotFoundError(f"no manifest at {url}; pass the OUTPUT folder of an extraction run (it holds "
                                f"{RUN_FILE} and {MANIFEST_DIR}/)")
    kwargs = {} if storage.is_local(fs) else {"filesystem": fs}
    try:
        schema = pq.ParquetDataset(mdir, **kwargs).schema
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"cannot read the manifest at {url} as Parquet: {e}") from e
    missing = [c for c in MANIFEST_COLUMNS if c not in schema.names]
    if missing:
        raise ValueError(f"manifest at {url} lacks columns {missing} (it has {schema.names}); it was not written by "
                         "an hsx extraction job")
    table = pq.read_table(mdir, columns=list(MANIFEST_COLUMNS), **kwargs)
    total = table.num_rows
    table = table.filter(pc.equal(table["status"], STATUS_OK))
    if table.num_rows == 0:
        raise ValueError(f"manifest at {url} has {total} rows and none with status 'ok'; the run has no usable "
                         "samples (see its 'error' column for why they failed)")
    table = table.select(["sample_id", "path", "num_tokens"]).append_column(
        "_row", pa.array(np.arange(table.num_rows, dtype=np.int64)))
    if pc.count_distinct(table["sample_id"]).as_py() != table.num_rows:
        # several "ok" rows for one sample (a resumed run): keep the last one written
        keep = table.group_by("sample_id", use_threads=False).aggregate([("_row", "max")])["_row_max"]
        table = table.take(keep)
    table = table.take(pc.sort_indices(table, sort_keys=[("sample_id", "ascending")]))
    return table.drop_columns(["_row"]).combine_chunks()


# -- reading one file -------------------------------------------------------------------------------------------


def _read_header(fs, path: str) -> HiddenStatesFileInfo:
    return read_header(storage.full_url(fs, path), lambda: fs.size(path),
                       lambda start, end: fs.cat_file(path, start=start, end=end))[0]


def _read_rows(fs, path: str, local: bool, max_rows: int | None) -> tuple[HiddenStatesFileInfo, dict]:
    """Header and the leading `max_rows` rows of every tensor (all rows when None)."""
    if local:
        # memory-mapped, copy-on-write: tensors share the page cache (no copy), in-place edits stay private
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ValueError(f"{path}: {size} bytes is too short for a safetensors file")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        info, _ = read_header(path, size, lambda start, end: mm[start:end])
        rows = info.num_tokens if max_rows is None else min(max_rows, info.num_tokens)
        out = {}
        for name in (TOKEN_IDS, HIDDEN_STATES, LOSS_MASK):
            if name in info.tensors:
                e = info.tensors[name]
                shape = (rows, *e.shape[1:])
                count = math.prod(shape)
                out[name] = (torch.frombuffer(mm, dtype=e.dtype, count=count, offset=e.start).reshape(shape)
                             if count else torch.empty(shape, dtype=e.dtype))
        return info, out

    url = storage.full_url(fs, path)
    info, probe = read_header(url, lambda: fs.size(path), lambda start, end: fs.cat_file(path, start=start, end=end))
    whole = len(probe) == info.size  # a small file arrives whole with its header
    rows = info.num_tokens if max_rows is None else min(max_rows, info.num_tokens)
    names = [n for n in (TOKEN_IDS, HIDDEN_STATES, LOSS_MASK) if n in info.tensors]
    spans = [(info.tensors[n].start, info.tensors[n].start + rows * info.tensors[n].row_bytes) for n in names]
    if whole:
        blobs = [probe[a:b] for a, b in spans]
    else:
        todo = [i for i, (a, b) in enumerate(spans) if b > a]
        fetched = fs.cat_ranges([path] * len(todo), [spans[i][0] for i in todo], [spans[i][1] for i in todo],
                                on_error="raise") if todo else []
        blobs = [b""] * len(spans)
        for i, blob in zip(todo, fetched):
            blobs[i] = blob
    out = {}
    for n, (a, b), blob in zip(names, spans, blobs):
        if len(blob) != b - a:
            raise ValueError(f"{url}: got {len(blob)} bytes of tensor {n!r}, expected {b - a}; the file is truncated")
        out[n] = tensor_from_bytes(bytearray(blob), info.tensors[n], rows)
    return info, out


# -- the target model's final norm ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FinalNorm:
    """The target model's final norm, to turn a stored pre-norm last layer into the post-norm state.

    Matches transformers' own modules: RMSNorm (Llama, Qwen, Mistral) normalises in float32, casts back to the
    input dtype, then scales by the weight; LayerNorm (GPT-2) is torch's layer_norm.
    """

    kind: str
    """"rms" or "layer"."""
    weight: torch.Tensor
    """[H], in the checkpoint's dtype."""
    eps: float
    """The config's rms_norm_eps / layer_norm_epsilon."""
    bias: torch.Tensor | None = None
    """[H] for LayerNorm."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of `x` ([..., H]); the result has the dtype transformers would give."""
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"final norm has width {self.weight.shape[0]} but the hidden states have "
                             f"{x.shape[-1]}; the model folder does not belong to this run")
        if self.kind == "layer":
            return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight.to(x.dtype),
                                                  None if self.bias is None else self.bias.to(x.dtype), self.eps)
        in_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(in_dtype)

    @classmethod
    def from_model_dir(cls, model_dir: str) -> FinalNorm:
        """Load only the final norm's weights from a local transformers checkpoint (config.json + safetensors)."""
        from safetensors import safe_open

        cfg_path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in {model_dir!r}; pass the target model's local folder as "
                                    "model_dir (hsx never downloads models)")
        with open(cfg_path) as f:
            config = json.load(f)
        model_type = config.get("model_type", "")
        if model_type not in _NORM_KINDS and isinstance(config.get("text_config"), dict):
            config = config["text_config"]
            model_type = config.get("model_type", model_type)
        kind = _NORM_KINDS.get(model_type)
        if kind is None:
            raise ValueError(f"the final norm of model_type {model_type!r} is not supported (supported: "
                             f"{sorted(_NORM_KINDS)}); extract with the last layer normalised, or apply the norm in "
                             "your trainer")
        eps = config.get("rms_norm_eps") if kind == "rms" else config.get("layer_norm_epsilon")
        if eps is None:
            raise ValueError(f"{cfg_path} has no {'rms_norm_eps' if kind == 'rms' else 'layer_norm_epsilon'}")

        index_path = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(model_dir, "model.safetensors")):
            with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir!r}; the "
                                    "final norm is read from safetensors checkpoints only")
        key = next((k for k in _NORM_KEYS[kind] if k in weight_map), None)
        if key is None:
            raise ValueError(f"{model_dir!r} holds none of {list(_NORM_KEYS[kind])}; cannot find the final norm")
        with safe_open(os.path.join(model_dir, weight_map[key]), framework="pt") as f:
            weight = f.get_tensor(key)
            bias_key = key.removesuffix("weight") + "bias"
            bias = f.get_tensor(bias_key) if kind == "layer" and bias_key in f.keys() else None
        return cls(kind=kind, weight=weight, eps=float(eps), bias=bias)


# -- the dataset ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HiddenStatesDatasetConfig:
    """What a `HiddenStatesDataset` item holds and how files are read."""

    layout: str = "raw"
    """"raw": hidden_states [T, L, H]; "eagle3": aux_hidden_states [T, (L-1)*H] (every stored layer but the last,
    concatenated in stored order) and target_hidden_states [T, H] (the last stored layer)."""
    normalize_last_layer: bool = False
    """Apply the target model's final norm to the last stored layer when the run stored it pre-norm (a no-op for
    runs that stored it normalised). Needs the last stored id to be N and the model's folder (`model_dir`)."""
    model_dir: str | None = None
    """Local folder of the target model, for its final norm; default: the run's `model` when that is a folder."""
    max_length: int | None = None
    """Keep at most this many leading tokens per sample; only those bytes are read."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for the run's URL (endpoint_url, credentials, ...)."""
    cache_dir: str | None = None
    """Remote runs only: download each file whole into this folder on first read and read it from there after
    (fsspec's filecache). Off by default: remote reads fetch byte ranges."""
    include_sample_id: bool = True
    """Add the sample's id (a str) to each item as "sample_id"."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {list(LAYOUTS)}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1 (or None for whole samples), got {self.max_length}")


class HiddenStatesDataset(Dataset):
    """A map-style dataset over one or more extraction runs. See the module docstring for the item layout.

        ds = HiddenStatesDataset("s3://bucket/run", layout="eagle3", storage_options={...})
        ds[0]["aux_hidden_states"].shape    # [T, (L-1)*H]
    """

    def __init__(self, output: str | Sequence[str], config: HiddenStatesDatasetConfig | None = None,
                 **overrides: Any) -> None:
        config = dataclasses.replace(config or HiddenStatesDatasetConfig(), **overrides)
        self.config = config
        outputs = [output] if isinstance(output, (str, os.PathLike)) else list(output)
        if not outputs:
            raise ValueError("no run given; pass an OUTPUT folder or URL (or a list of them)")
        self._outputs = [str(o) for o in outputs]

        fs0, _ = storage.open_url(self._outputs[0], config.storage_options)
        self._local = storage.is_local(fs0)
        roots, tables, infos = [], [], []
        for out in self._outputs:
            fs, root = storage.open_url(out, config.storage_options)
            if type(fs) is not type(fs0):
                raise ValueError(f"runs {self._outputs[0]} and {out} are on different filesystems; open them as "
                                 "separate datasets (torch.utils.data.ConcatDataset joins them)")
            table = _read_manifest(fs, root)
            info = _run_info(fs, root, posixpath.join(root, table["path"][0].as_py()))
            if infos and infos[0].differences(info):
                raise ValueError(f"runs {self._outputs[0]} and {out} differ in "
                                 f"{_describe(infos[0].differences(info))}; mixed runs cannot be read as one "
                                 "dataset — open them separately")
            roots.append(root)
            tables.append(table)
            infos.append(info)
        self.run_info: RunInfo = infos[0]
        self._roots = roots
        self._sample_ids = pa.concat_arrays([t["sample_id"].combine_chunks() for t in tables])
        self._paths = pa.concat_arrays([t["path"].combine_chunks() for t in tables])
        self._num_tokens = np.concatenate([t["num_tokens"].to_numpy() for t in tables]).astype(np.int64)
        self._run_of = np.repeat(np.arange(len(tables), dtype=np.int32), [t.num_rows for t in tables])

        info = self.run_info
        if config.layout == "eagle3" and len(info.layer_ids) < 2:
            raise ValueError(f"layout='eagle3' needs at least 2 stored layers (aux + target); the run stores "
                             f"{list(info.layer_ids)}. Use layout='raw'")
        self._norm: FinalNorm | None = None
        if config.normalize_last_layer and not info.last_layer_normalized:
            self._norm = _load_norm(info, config.model_dir)
        self._fs = None
        self._fs_pid: int | None = None

    # -- size and per-sample facts (from the manifest) --------------------------------------------------------
    def __len__(self) -> int:
        return len(self._paths)

    @property
    def num_tokens(self) -> np.ndarray:
        """[N] int64 token counts from the manifest (before `max_length`), for token-budget batching."""
        return self._num_tokens

    @property
    def sample_ids(self) -> pa.Array:
        """[N] sample ids (a pyarrow string array), in dataset order."""
        return self._sample_ids

    def sample_id(self, index: int) -> str:
        return self._sample_ids[index].as_py()

    def path(self, index: int) -> str:
        """The URL (or local path) of sample `index`'s file."""
        fs, _ = storage.open_url(self._outputs[0], self.config.storage_options)
        return storage.full_url(fs, self._abs_path(index))

    # -- reading ----------------------------------------------------------------------------------------------
    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} samples")
        fs = self._filesystem()
        path = self._abs_path(index)
        info, tensors = _read_rows(fs, path, self._local and self.config.cache_dir is None, self.config.max_length)
        self._check_file(info, index)
        ids = tensors[TOKEN_IDS]  # [T]
        states = tensors[HIDDEN_STATES]  # [T, L, H]
        mask = tensors[LOSS_MASK].to(torch.long) if LOSS_MASK in tensors else torch.ones_like(ids)  # [T]
        item: dict[str, Any] = {"input_ids": ids, "loss_mask": mask}
        if self.config.layout == "raw":
            if self._norm is not None:
                states[:, -1] = self._norm(states[:, -1])
            item["hidden_states"] = states
        else:
            t, n_layers, h = states.shape
            item["aux_hidden_states"] = states[:, :-1].reshape(t, (n_layers - 1) * h)  # [T, (L-1)*H]
            target = states[:, -1].contiguous()  # [T, H]
            item["target_hidden_states"] = self._norm(target) if self._norm is not None else target
        if self.config.include_sample_id:
            item["sample_id"] = self.sample_id(index)
        return item

    def _abs_path(self, index: int) -> str:
        return posixpath.join(self._roots[self._run_of[index]], self._paths[index].as_py())

    def _check_file(self, info: HiddenStatesFileInfo, index: int) -> None:
        run = self.run_info
        where = f"{info.path} (sample {self.sample_id(index)!r})"
        if info.has_hsx_metadata:
            theirs = _spec_fields(info.metadata)
            diff = {k: (getattr(run, k), v) for k, v in theirs.items() if getattr(run, k) != v}
            if diff:
                raise ValueError(f"{where} differs from its run in {_describe(diff)}; the run is mixed (files from "
                                 "another extraction were copied in?) — re-extract it or drop those samples")
        if info.num_layers != len(run.layer_ids) or info.hidden_size != run.hidden_size or info.dtype != run.torch_dtype:
            raise ValueError(f"{where} stores hidden_states [T, {info.num_layers}, {info.hidden_size}] {info.dtype}, "
                             f"but the run stores [T, {len(run.layer_ids)}, {run.hidden_size}] {run.dtype}; the run "
                             "is mixed")
        expected = int(self._num_tokens[index])
        if info.num_tokens != expected:
            raise ValueError(f"{where} holds {info.num_tokens} tokens but the manifest says {expected}; the file was "
                             "replaced after the manifest was written — re-run the extraction to repair the run")

    # -- per-process filesystem -------------------------------------------------------------------------------
    def _filesystem(self):
        if self._fs is None or self._fs_pid != os.getpid():
            fs, _ = storage.open_url(self._outputs[0], self.config.storage_options)
            if self.config.cache_dir is not None and not storage.is_local(fs):
                import fsspec

                fs = fsspec.filesystem("filecache", fs=fs, cache_storage=self.config.cache_dir,
                                       same_names=False, check_files=False)
            self._fs, self._fs_pid = fs, os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fs"] = None  # filesystems (event loops, sockets) are opened afresh in each worker
        state["_fs_pid"] = None
        return state

    def __repr__(self) -> str:
        info = self.run_info
        return (f"HiddenStatesDataset({len(self)} samples, {int(self._num_tokens.sum())} tokens, layers "
                f"{list(info.layer_ids)} of {info.model or '?'}, {info.dtype}, layout={self.config.layout!r})")


def _describe(diff: Mapping[str, tuple[Any, Any]]) -> str:
    return "; ".join(f"{k}: {a!r} vs {b!r}" for k, (a, b) in diff.items())


def _load_norm(info: RunInfo, model_dir: str | None) -> FinalNorm:
    last = info.layer_ids[-1]
    if last != info.num_hidden_layers:
        raise ValueError(f"normalize_last_layer applies the final norm to id {info.num_hidden_layers} (the last "
                         f"decoder layer), but the run's last stored id is {last}; drop the option or extract id "
                         f"{info.num_hidden_layers}")
    if info.layer_id_convention != LAYER_ID_CONVENTION:
        raise ValueError(f"the run counts layers in the {info.layer_id_convention!r} convention; normalize_last_layer "
                         f"supports {LAYER_ID_CONVENTION!r} runs only")
    if model_dir is None:
        if info.model and os.path.isfile(os.path.join(info.model, "config.json")):
            model_dir = info.model
        else:
            raise ValueError(f"normalize_last_layer needs the target model's local folder for its final norm; the run "
                             f"records model {info.model!r}, which is not a local folder. Pass model_dir=...")
    norm = FinalNorm.from_model_dir(model_dir)
    # as the engine ran it: the model's weights in the run's dtype
    return dataclasses.replace(norm, weight=norm.weight.to(info.torch_dtype),
                               bias=None if norm.bias is None else norm.bias.to(info.torch_dtype))


# -- distributed sampling ---------------------------------------------------------------------------------------


class ShardSampler(Sampler[int]):
    """Indices for one rank: a disjoint share of the dataset; the shares of all ranks cover it exactly once.

    Unlike torch's DistributedSampler, nothing is repeated to even out the shares: ranks differ by at most one
    sample. With `shuffle`, every rank draws the same permutation (from seed + epoch) and takes every
    num_replicas-th index of it; call `set_epoch` each epoch for a new order.
    """

    def __init__(self, dataset_or_size: Dataset | int, num_replicas: int | None = None, rank: int | None = None,
                 *, shuffle: bool = True, seed: int = 0) -> None:
        self.size = dataset_or_size if isinstance(dataset_or_size, int) else len(dataset_or_size)
        if num_replicas is None or rank is None:
            if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                raise ValueError("ShardSampler needs num_replicas and rank (or an initialised torch.distributed)")
            num_replicas = torch.distributed.get_world_size() if num_replicas is None else num_replicas
            rank = torch.distributed.get_rank() if rank is None else rank
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1} (num_replicas={num_replicas})")
        self.num_replicas, self.rank, self.shuffle, self.seed = num_replicas, rank, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=g)
        else:
            order = torch.arange(self.size)
        return iter(order[self.rank::self.num_replicas].tolist())

    def __len__(self) -> int:
        return max(0, math.ceil((self.size - self.rank) / self.num_replicas))
