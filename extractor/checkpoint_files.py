"""A local checkpoint folder's safetensors files: which file holds a tensor, and the tensors themselves.

    weight_map(folder, reader) -> {name: file}        model.safetensors.index.json's weight_map, or the one
                                                      model.safetensors' header (no tensor read)
    load_tensors(folder, names, dtype=None, files=None) -> {name: tensor}   only the named tensors, each file
                                                      opened once (files: a weight_map already read)

The one reader of checkpoint weight maps: the final norm (extractor/norm.py), the target's embeddings and lm_head
(drafters/base.py) and a target's MTP layers (drafters/mtp_checkpoint.py) all read through it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

import torch

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def weight_map(folder: str, reader: str = "hsx reads its tensors") -> dict[str, str]:
    """Tensor name -> safetensors file name of a local checkpoint, a single file or an index + shards;
    FileNotFoundError saying what `reader` ("the final norm is read", ...) needs."""
    from safetensors import safe_open

    index_path = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            return dict(json.load(f)["weight_map"])
    if os.path.isfile(os.path.join(folder, WEIGHTS_NAME)):
        with safe_open(os.path.join(folder, WEIGHTS_NAME), framework="pt") as f:
            return dict.fromkeys(f.keys(), WEIGHTS_NAME)
    raise FileNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {folder!r}; {reader} from a local safetensors "
                            "checkpoint (hsx never downloads models)")


def load_tensors(folder: str, names: Iterable[str], dtype: torch.dtype | None = None, *,
                 files: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The named tensors of the checkpoint at `folder` (floating ones cast to `dtype` when given), read from the
    files holding them, each opened once. `files`: the folder's weight_map when the caller has it already.
    ValueError naming the tensor and the folder when the checkpoint holds no such tensor."""
    from safetensors import safe_open

    files = weight_map(folder) if files is None else files
    by_file: dict[str, list[str]] = {}
    for name in dict.fromkeys(names):
        if name not in files:
            raise ValueError(f"{folder!r}: the checkpoint holds no tensor {name!r} (its weight map lists "
                             f"{len(files)} tensors); is this the model folder it should be?")
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, keys in by_file.items():
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            for key in keys:
                out[key] = f.get_tensor(key)
    if dtype is not None:
        out = {k: t.to(dtype) if t.is_floating_point() else t for k, t in out.items()}
    return out
