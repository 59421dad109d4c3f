"""extractor.checkpoint_files: the one reader of a checkpoint folder's weight map, on a single file and on shards."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from extractor.checkpoint_files import load_tensors, weight_map

TENSORS = {"model.embed_tokens.weight": torch.arange(12, dtype=torch.float32).view(4, 3),
           "model.norm.weight": torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16),
           "lm_head.weight": torch.full((4, 3), 0.5),
           "model.layers.0.mlp.experts.ids": torch.tensor([3, 1, 2])}


def _single(folder) -> str:
    os.makedirs(folder)
    save_file(TENSORS, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def _sharded(folder) -> str:
    """Two shards and the index that names them, as save_pretrained writes a large model."""
    os.makedirs(folder)
    names = sorted(TENSORS)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for file, keys in shards.items():
        save_file({k: TENSORS[k] for k in keys}, os.path.join(folder, file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return str(folder)


@pytest.mark.parametrize("layout", [_single, _sharded])
def test_the_weight_map_names_the_file_holding_each_tensor(tmp_path, layout):
    folder = layout(tmp_path / "model")
    files = weight_map(folder)
    assert set(files) == set(TENSORS)
    for name, file in files.items():
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            assert name in f.keys()
    if layout is _sharded:
        assert len(set(files.values())) == 2


@pytest.mark.parametrize("layout", [_single, _sharded])
def test_only_the_named_tensors_are_loaded_with_their_stored_values(tmp_path, layout):
    folder = layout(tmp_path / "model")
    names = ["lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"]
    got = load_tensors(folder, names)
    assert sorted(got) == sorted(names)
    for name in names:
        assert got[name].dtype == TENSORS[name].dtype and torch.equal(got[name], TENSORS[name])


def test_dtype_casts_floating_tensors_only(tmp_path):
    folder = _sharded(tmp_path / "model")
    got = load_tensors(folder, list(TENSORS), dtype=torch.float16)
    assert {name: t.dtype for name, t in got.items()} == {
        "model.embed_tokens.weight": torch.float16, "model.norm.weight": torch.float16,
        "lm_head.weight": torch.float16, "model.layers.0.mlp.experts.ids": torch.int64}
    assert torch.equal(got["model.embed_tokens.weight"].float(), TENSORS["model.embed_tokens.weight"])


@pytest.mark.parametrize("layout", [_single, _sharded])
def test_a_missing_tensor_is_refused_naming_the_tensor_and_the_folder(tmp_path, layout):
    folder = layout(tmp_path / "model")
    with pytest.raises(ValueError) as e:
        load_tensors(folder, ["model.norm.weight", "model.layers.7.mlp.down_proj.weight"])
    message = str(e.value)
    assert "model.layers.7.mlp.down_proj.weight" in message and folder in message and "\n" not in message


def test_a_folder_without_safetensors_says_what_the_reader_needs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json.*the final norm"):
        weight_map(str(tmp_path), "the final norm is read")
