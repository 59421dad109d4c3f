"""The training feed: a torch Dataset over an extraction run, opened from its manifest alone.

    HiddenStatesDataset(output, ...)   one item per "ok" sample of a run (or of several runs with the same spec):
                                         raw:    input_ids [T], loss_mask [T], hidden_states [T, L, H] (with
                                                 dequantize=False as stored: an fp8 run's beside
                                                 hidden_states_scales [T, L, 1])
                                         eagle3: input_ids [T], loss_mask [T],
                                                 aux_hidden_states [T, (L-1)*H], target_hidden_states [T, H]
                                         a top-k target run (`--target top_k:K`) adds target_topk_ids [T, K] and
                                         target_topk_logprobs [T, K] to both; its eagle3 items hold every stored
                                         layer as aux_hidden_states [T, L*H] and no target_hidden_states
    ds.token_items()                   input_ids and loss_mask of every sample, reading only those two tensors (a
                                       tokens-only pass, e.g. EAGLE-3's draft vocabulary; checksums are checked
                                       when the items themselves are read)
    HiddenStatesDatasetConfig          what an item holds: layout, final norm, truncation, local cache
    ds.run_info                        the run's `connectors.run.RunSpec` (layers, dtype, model, norm status, ...)
    read_run_info(output)              that RunSpec: `connectors.run.read_run_spec`, or, for a run without run.json,
                                       the spec in its first "ok" file's header

A run is the folder (or URL) an extraction job writes; `connectors.run` owns its format (run.json, data/,
manifest/). Opening reads run.json and the manifest (`connectors.manifest.ok_rows`: one "ok" row per sample, the last
written when a resume wrote it twice), never the data files — unless the run has no run.json, which costs one header
read of the first file. Items are read by `connectors.reader.read_rows`: one small request for a small file (header
and data together), or header + byte ranges for a large one, so `max_length` fetches only the leading tokens; local
files are memory-mapped.
The filesystem is opened lazily in each process, so the dataset pickles into DataLoader workers (fork or spawn).

Every file is checked against the run's spec when it is read (`HiddenStatesSpec.file_problem`): a file from another
model, other layers or another dtype fails loudly instead of training on a mixed run. Nothing in a file is trusted:
its header is checked against its real size before any data is read, a local path that is not a regular file is
refused without blocking, and (`verify`, on by default) its data must match the checksum in its header — the whole
data region is hashed, also when `max_length` keeps only the leading tokens. A file that fails any of these raises
`connectors.format.HiddenStatesFileError` naming it and the problem.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import posixpath
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from connectors import storage
from connectors.format import (
    COMPARED_FIELDS,
    HIDDEN_STATES,
    HIDDEN_STATES_SCALES,
    LAYER_ID_CONVENTION,
    LOSS_MASK,
    MM_EMBEDS,
    MM_TOKEN_TYPE_IDS,
    POSITION_IDS,
    TARGET_TOPK_IDS,
    TARGET_TOPK_LOGPROBS,
    TOKEN_IDS,
    HiddenStatesFileError,
)
from connectors.header import HiddenStatesFileInfo
from connectors.manifest import ok_rows, row_file_problem, row_path_problem, sample_range
from connectors.reader import read_hidden_states_info, read_rows
from connectors.run import RunDir, RunSpec, read_run_spec
from extractor.norm import FinalNorm

logger = logging.getLogger(__name__)

LAYOUTS = ("raw", "eagle3")
IMAGE_INPUTS = ("vision", "placeholder")
RUN_COMPARED = (*COMPARED_FIELDS, "layer_id_convention")
"""RunSpec fields two runs must share to be read as one dataset."""


# -- the run's spec ---------------------------------------------------------------------------------------------


def read_run_info(output: str | RunDir, *, storage_options: dict | None = None) -> RunSpec:
    """The RunSpec of the run at `output`: `connectors.run.read_run_spec`, with one fallback — a run without
    run.json (written with the offline API alone) gets the spec recorded in its first "ok" file's header."""
    run = output if isinstance(output, RunDir) else RunDir(str(output), storage_options)
    return _run_spec(run, ok_rows(run))


def _run_spec(run: RunDir, rows: pa.Table) -> RunSpec:
    spec = read_run_spec(run)
    if spec is not None:
        return spec
    first = run.path(rows["path"][0].as_py())
    header = read_hidden_states_info(storage.full_url(run.fs, first), storage_options=run.storage_options,
                                     byte_range=sample_range(rows["offset"][0].as_py(), rows["bytes"][0].as_py()))
    file_spec = header.spec
    if file_spec is None:
        raise ValueError(f"{run.url}: cannot tell the run's spec — it has no run.json, and its first data file "
                         f"{storage.full_url(run.fs, first)} carries no hsx metadata. Is this an hsx run? (files "
                         "written by vLLM carry no metadata; load them with load_hidden_states instead)")
    return RunSpec.from_file_spec(file_spec)


# -- reading one file -------------------------------------------------------------------------------------------


_REEXTRACT = "run `hsx verify OUTPUT --all` (it marks the sample) and re-run the same `hsx run` to extract it again"
"""The fix for a committed sample that cannot be read as its manifest row commits it."""


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
    dequantize: bool = True
    """Give states back in the model dtype (fp8 dequantized with its scales, other storage dtypes cast). False:
    raw items hold hidden_states as the run stores them, and for an fp8 run its hidden_states_scales [T, L, 1]
    (value = fp8 x scale), for a reader that takes fp8 itself (speculators' export). Needs layout "raw" without
    normalize_last_layer."""
    image_inputs: str = "vision"
    """What a drafter reads at the image tokens of a multimodal run (files with mm_token_type_ids): "vision" (items
    carry image_embeds [T, H], the merged input embeddings the run stored with --mm-embeds: what vLLM's proposer
    feeds the drafter there; a run without them is refused) or "placeholder" (the image token's own embedding, as
    peers trained). Either way items carry image_mask [T], the loss mask is 0 at image tokens, and items carry
    positions [T]: the target's positions (M-RoPE: the time stream), which collators give drafters as position_ids,
    as vLLM's proposer feeds them."""
    verify: bool = True
    """Check every item's data against the checksum in its file's header (xxh3_64, a few GB/s per core); a damaged
    file raises HiddenStatesFileError. The whole data region is hashed, so with `max_length` the rest of each file
    is read too. Files without a checksum (vLLM's) are read unverified. Turn off for speed on trusted storage."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of {list(LAYOUTS)}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1 (or None for whole samples), got {self.max_length}")
        if self.image_inputs not in IMAGE_INPUTS:
            raise ValueError(f"image_inputs {self.image_inputs!r} is not one of {list(IMAGE_INPUTS)}")
        if not self.dequantize and (self.layout != "raw" or self.normalize_last_layer):
            raise ValueError("dequantize=False gives states as stored, which only layout='raw' without "
                             "normalize_last_layer can hold; drop dequantize=False, or use that layout")


class HiddenStatesDataset(Dataset):
    """A map-style dataset over one or more extraction runs. See the module docstring for the item layout.

        ds = HiddenStatesDataset("s3://bucket/run", layout="eagle3", storage_options={...})
        ds[0]["aux_hidden_states"].shape    # [T, (L-1)*H]
        ds.run_info.layer_ids               # the run's RunSpec (connectors.run)
    """

    def __init__(self, output: str | Sequence[str], config: HiddenStatesDatasetConfig | None = None,
                 **overrides: Any) -> None:
        config = dataclasses.replace(config or HiddenStatesDatasetConfig(), **overrides)
        self.config = config
        outputs = [output] if isinstance(output, (str, os.PathLike)) else list(output)
        if not outputs:
            raise ValueError("no run given; pass an OUTPUT folder or URL (or a list of them)")
        self._outputs = [str(o) for o in outputs]

        runs = [RunDir(out, config.storage_options) for out in self._outputs]
        tables, specs = [], []
        for out, run in zip(self._outputs, runs):
            if type(run.fs) is not type(runs[0].fs):
                raise ValueError(f"runs {self._outputs[0]} and {out} are on different filesystems; open them as "
                                 "separate datasets (torch.utils.data.ConcatDataset joins them)")
            table = ok_rows(run)
            spec = _run_spec(run, table)
            diff = specs[0].differences(spec, RUN_COMPARED) if specs else {}
            if diff:
                raise ValueError(f"runs {self._outputs[0]} and {out} differ in {_describe(diff)}; mixed runs cannot "
                                 "be read as one dataset — open them separately")
            tables.append(table)
            specs.append(spec)
        self.run_info: RunSpec = specs[0]  # run.json, or the first file's header for a run without one
        self._file_spec = self.run_info.file_spec()
        self._roots = [run.root for run in runs]
        self._sample_ids = pa.concat_arrays([t["sample_id"].combine_chunks() for t in tables])
        self._paths = pa.concat_arrays([t["path"].combine_chunks() for t in tables])
        self._checksums = pa.concat_arrays([t["checksum"].combine_chunks() for t in tables])
        # --layout sharded: each sample's (offset, length) in its shard; None when no run holds a shard
        sharded = any(t["offset"].null_count < t.num_rows for t in tables)
        self._offsets = np.concatenate([t["offset"].fill_null(-1).to_numpy() for t in tables]).astype(np.int64) \
            if sharded else None
        self._lengths = np.concatenate([t["bytes"].fill_null(-1).to_numpy() for t in tables]).astype(np.int64) \
            if sharded else None
        # a row without a token count (a damaged manifest) reads as -1: its file's count never matches it
        self._num_tokens = np.concatenate([t["num_tokens"].fill_null(-1).to_numpy() for t in tables]
                                          ).astype(np.int64)
        self._run_of = np.repeat(np.arange(len(tables), dtype=np.int32), [t.num_rows for t in tables])

        info = self.run_info
        self._top_k = info.target_top_k
        self._names = (TOKEN_IDS, HIDDEN_STATES, LOSS_MASK, MM_TOKEN_TYPE_IDS, POSITION_IDS) + (
            (TARGET_TOPK_IDS, TARGET_TOPK_LOGPROBS) if self._top_k is not None else ()) + (
            (MM_EMBEDS,) if config.image_inputs == "vision" else ())
        if config.layout == "eagle3" and self._top_k is None and len(info.layer_ids) < 2:
            raise ValueError(f"layout='eagle3' needs at least 2 stored layers (aux + target); the run stores "
                             f"{list(info.layer_ids)}. Use layout='raw'")
        if config.image_inputs == "vision" and info.image_processing and not info.mm_embeds:
            raise ValueError("the run is an image run stored without the image embeddings (hsx run --mm-embeds): "
                             "re-extract with --mm-embeds to train with the vision embeddings at image tokens, or "
                             "train with --image-inputs placeholder")
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

    def committed_digest(self) -> str:
        """sha256 over every sample's manifest row as the dataset reads it (id, path, token count, checksum), in
        dataset order: equal exactly when the dataset reads the same committed files."""
        import hashlib

        digest = hashlib.sha256()
        step = 65536
        for start in range(0, len(self), step):
            rows = zip(self._sample_ids.slice(start, step).to_pylist(), self._paths.slice(start, step).to_pylist(),
                       self._num_tokens[start:start + step].tolist(), self._checksums.slice(start, step).to_pylist())
            digest.update(json.dumps(list(rows)).encode())
        return digest.hexdigest()

    def sample_id(self, index: int) -> str:
        return self._sample_ids[index].as_py()

    def path(self, index: int) -> str:
        """The URL (or local path) of sample `index`'s file (or shard: see byte_range)."""
        fs, _ = storage.open_url(self._outputs[0], self.config.storage_options)
        return storage.full_url(fs, self._abs_path(index))

    # -- reading ----------------------------------------------------------------------------------------------
    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} samples")
        item, tensors = self._read(index, self.config.verify, self._names)  # input_ids, loss_mask [T]
        states = tensors[HIDDEN_STATES]  # [T, L, H]
        if MM_TOKEN_TYPE_IDS in tensors:  # a multimodal run: no loss at image tokens, their input embeddings
            self._image_inputs(index, item, tensors, states)
        if self._top_k is not None:  # the target's top-K next tokens stand in for layer N
            item[TARGET_TOPK_IDS] = tensors[TARGET_TOPK_IDS]  # [T, K] int32
            item[TARGET_TOPK_LOGPROBS] = tensors[TARGET_TOPK_LOGPROBS]  # [T, K] float32
        if self.config.layout == "raw":
            if self._norm is not None:
                states[:, -1] = self._norm(states[:, -1])
            item["hidden_states"] = states
            if HIDDEN_STATES_SCALES in tensors:  # dequantize=False on an fp8 run
                item[HIDDEN_STATES_SCALES] = tensors[HIDDEN_STATES_SCALES]  # [T, L, 1] float32
        elif self._top_k is not None:
            t, n_layers, h = states.shape
            item["aux_hidden_states"] = states.reshape(t, n_layers * h)  # [T, L*H]: every stored layer is aux
        else:
            t, n_layers, h = states.shape
            item["aux_hidden_states"] = states[:, :-1].reshape(t, (n_layers - 1) * h)  # [T, (L-1)*H]
            target = states[:, -1].contiguous()  # [T, H]
            item["target_hidden_states"] = self._norm(target) if self._norm is not None else target
        if self.config.include_sample_id:
            item["sample_id"] = self.sample_id(index)
        return item

    def _image_inputs(self, index: int, item: dict[str, Any], tensors: dict, states: torch.Tensor) -> None:
        """An image sample's item fields: image_mask [T] (loss off there) and, with image_inputs "vision", image_embeds
        [T, H] (the stored merged embeddings at image tokens, zeros elsewhere)."""
        image = tensors[MM_TOKEN_TYPE_IDS] != 0  # [T]
        item["loss_mask"] = item["loss_mask"] * (~image).long()
        item["image_mask"] = image.to(torch.uint8)
        if POSITION_IDS in tensors:  # the positions vLLM feeds a drafter: the target's (M-RoPE: the time stream)
            item["positions"] = tensors[POSITION_IDS][:, 0].to(torch.long)
        if self.config.image_inputs != "vision":
            return
        n = int(image.sum())
        embeds = tensors.get(MM_EMBEDS)
        if n and (embeds is None or embeds.shape[0] < n):
            raise ValueError(f"{self.path(index)} (sample {self.sample_id(index)!r}) has {n} image tokens and "
                             f"{0 if embeds is None else embeds.shape[0]} stored input embeddings: extract with "
                             "--mm-embeds for image_inputs='vision', or train with image_inputs='placeholder'")
        values = torch.zeros((image.shape[0], states.shape[-1]), dtype=states.dtype)
        if n:
            values[image] = embeds[:n].to(states.dtype)
        item["image_embeds"] = values

    def token_items(self, threads: int = 16, on_error: Callable[[int, Exception], None] | None = None
                    ) -> Iterator[dict[str, torch.Tensor]]:
        """Every sample's input_ids [T] and loss_mask [T] (T after `max_length`, as items have; 0 at image tokens), in
        dataset order, reading only those tensors' bytes from each file (one small read each; remote files `threads`
        at a time) — for passes over the tokens alone, such as counting EAGLE-3's draft vocabulary, that would otherwise
        read every hidden state. Headers are checked as for items; checksums are not (they cover the whole data
        region): the states, and the checksum, are checked when the items themselves are read. A sample that cannot
        be read raises at its place, or, with `on_error(index, error)`, is reported there and left out."""
        from concurrent.futures import ThreadPoolExecutor

        def read(index: int) -> dict[str, torch.Tensor] | None:
            try:
                item, tensors = self._read(index, False, (TOKEN_IDS, LOSS_MASK, MM_TOKEN_TYPE_IDS))
                if MM_TOKEN_TYPE_IDS in tensors:  # image tokens are never trained: as items have it
                    item["loss_mask"] = item["loss_mask"] * (tensors[MM_TOKEN_TYPE_IDS] == 0).long()
                return item
            except (OSError, ValueError) as e:
                if on_error is None:
                    raise
                on_error(index, e)
                return None

        if storage.is_local(self._filesystem()):
            yield from (item for item in map(read, range(len(self))) if item is not None)
            return
        threads = max(1, threads)
        step = 8 * threads  # futures submitted ahead of the reader: a bounded window, not one per sample at once
        with ThreadPoolExecutor(threads, thread_name_prefix="hsx-tokens") as pool:
            for start in range(0, len(self), step):  # in order; a failed read raises at its sample
                chunk = pool.map(read, range(start, min(len(self), start + step)))
                yield from (item for item in chunk if item is not None)

    def _read(self, index: int, verify: bool, names: Sequence[str]) -> tuple[dict[str, Any], dict]:
        """Sample `index`'s file read (the tensors in `names`) and checked against its run: ({"input_ids" [T],
        "loss_mask" [T] (all ones when the file has none)}, the tensors read)."""
        path = self._abs_path(index)
        try:
            info, tensors = read_rows(self._filesystem(), path, self.config.max_length, verify=verify, names=names,
                                      dequantize=self.config.dequantize, byte_range=self.byte_range(index))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{path} (sample {self.sample_id(index)!r}) is missing, though the manifest "
                                    f"commits it; {_REEXTRACT}") from e
        self._check_file(info, index)
        ids = tensors[TOKEN_IDS]
        mask = tensors[LOSS_MASK].to(torch.long) if LOSS_MASK in tensors else torch.ones_like(ids)
        return {"input_ids": ids, "loss_mask": mask}, tensors

    def byte_range(self, index: int) -> tuple[int, int] | None:
        """(offset, length) of sample `index` in its shard (a run of --layout sharded); None for a file of its own."""
        if self._offsets is None or self._offsets[index] < 0:
            return None
        return sample_range(int(self._offsets[index]), int(self._lengths[index]))

    def _abs_path(self, index: int) -> str:
        rel = self._paths[index].as_py()
        root = self._roots[self._run_of[index]]
        if (problem := row_path_problem(rel)) is not None:
            raise HiddenStatesFileError(root, f"sample {self.sample_id(index)!r}: {problem}; {_REEXTRACT}")
        return posixpath.join(root, rel)

    def _check_file(self, info: HiddenStatesFileInfo, index: int) -> None:
        where = f"{info.path} (sample {self.sample_id(index)!r})"
        if (problem := self._file_spec.file_problem(info)) is not None:
            raise ValueError(f"{where} is not one of its run's files: {problem}; the run is mixed (files from "
                             "another extraction were copied in?) — re-extract it or drop those samples")
        mismatch = row_file_problem(info, self.sample_id(index), int(self._num_tokens[index]),
                                    self._checksums[index].as_py())
        if mismatch is not None:
            raise ValueError(f"{where}: {mismatch[1]}; the file was replaced after it was committed, or the row "
                             f"points at another sample's file — {_REEXTRACT}")

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


def _load_norm(run: RunSpec, model_dir: str | None) -> FinalNorm:
    if run.target_top_k is not None:
        raise ValueError(f"normalize_last_layer: the run keeps a {run.target} target in place of layer "
                         f"{run.num_hidden_layers}, so there is no last layer to normalise; drop the option")
    last = run.layer_ids[-1]
    if last != run.num_hidden_layers:
        raise ValueError(f"normalize_last_layer applies the final norm to id {run.num_hidden_layers} (the last "
                         f"decoder layer), but the run's last stored id is {last}; drop the option or extract id "
                         f"{run.num_hidden_layers}")
    if run.layer_id_convention != LAYER_ID_CONVENTION:
        raise ValueError(f"the run counts layers in the {run.layer_id_convention!r} convention; normalize_last_layer "
                         f"supports {LAYER_ID_CONVENTION!r} runs only")
    if model_dir is None:
        if run.model and os.path.isfile(os.path.join(run.model, "config.json")):
            model_dir = run.model
        else:
            raise ValueError(f"normalize_last_layer needs the target model's local folder for its final norm; the run "
                             f"records model {run.model!r}, which is not a local folder. Pass model_dir=...")
    # as the engine ran it: the model's weights in the run's dtype
    return FinalNorm.from_model_dir(model_dir).to(run.torch_dtype)
