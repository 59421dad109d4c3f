"""The top-k target (issue 25): files that keep the target's top-K next-token log-probabilities in place of the last
layer — written on every backend, read whole and by token range, checked like every other tensor, refused when
hostile, and never committed with a non-finite log-probability."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from connectors.base import RequestInfo
from connectors.example_hidden_states_connector import load_hidden_states, read_hidden_states_info
from connectors.format import (
    HIDDEN_STATES,
    TARGET_TOPK_IDS,
    TARGET_TOPK_LOGPROBS,
    TOKEN_IDS,
    HiddenStatesFileError,
    HiddenStatesSpec,
    check_target,
)
from connectors.header import encode_header, file_entries, file_size
from connectors.quant import BadStates
from connectors.reader import verify_hidden_states
from tests.connectors.conftest import make_spec

K = 8
LAYERS = (2, 4, 6)  # of N = 8: the last layer is the top-k target's


def topk_spec(dtype=torch.float32, k: int = K) -> HiddenStatesSpec:
    return dataclasses.replace(make_spec(dtype, LAYERS, 32), target=f"top_k:{k}")


def topk_rows(num_tokens: int, k: int = K, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] int32 ids and float32 log-probabilities, best first, as a log_softmax's top-k gives them."""
    g = torch.Generator().manual_seed(seed)
    top = torch.randn(num_tokens, 1000, generator=g).log_softmax(-1).topk(k)
    return top.indices.to(torch.int32), top.values


def save(connector, rid: str, token_ids, states, ids, logprobs, chunks: int = 3) -> str:
    connector.start_request(RequestInfo(rid, token_ids.shape[0], {}))
    for parts in zip(*(t.tensor_split(chunks) for t in (token_ids, states, ids, logprobs))):
        connector.save_hidden_states(rid, parts[0], parts[1], {TARGET_TOPK_IDS: parts[2], TARGET_TOPK_LOGPROBS: parts[3]})
    return connector.request_finished(rid)["hidden_states_path"]


def test_target_names_are_checked_and_the_last_layer_is_not_also_stored():
    assert check_target(None) == check_target("states") == ""
    assert check_target(" top_k:064 ") == "top_k:64"
    for bad in ("top_k:0", "top_k:-1", "top_k:abc", "topk:4", "logits", "top_k:100000"):
        with pytest.raises(ValueError, match=r"--target .* is not a target; use 'states'"):
            check_target(bad, flag="--target")
    with pytest.raises(ValueError, match="stands for layer 8 .* not also stored"):
        HiddenStatesSpec((2, 8), 8, 32, "float32", target="top_k:4")
    spec = topk_spec()
    assert spec.top_k == K and spec.to_metadata()["target"] == f"top_k:{K}"
    assert "target" not in make_spec().to_metadata()  # files of the states target are as before
    assert HiddenStatesSpec.from_metadata(spec.to_metadata()) == spec
    assert make_spec().differences(spec) == {"target": ("", f"top_k:{K}")}


@pytest.mark.parametrize("storage", ["model", "fp8"])
def test_topk_round_trip_on_every_backend_whole_and_by_token_range(backend, connector_factory, storage):
    spec = topk_spec()
    connector = connector_factory(backend.root, spec, storage_options=backend.storage_options, storage_dtype=storage)
    token_ids = torch.arange(100, 400)
    states = torch.randn(300, len(LAYERS), 32)
    ids, logprobs = topk_rows(300)
    path = save(connector, "topk-1", token_ids, states, ids, logprobs)
    assert connector.wait_for_save() == {}

    info = read_hidden_states_info(path, storage_options=backend.storage_options)
    assert info.top_k == K and info.spec.target == f"top_k:{K}" and info.num_layers == len(LAYERS)
    meta = {**info.metadata}
    assert info.size == file_size(file_entries(info.spec, 300, loss_mask=False), meta)  # estimate sizes it exactly
    out = load_hidden_states(path, storage_options=backend.storage_options, verify=True)
    assert torch.equal(out[TARGET_TOPK_IDS], ids) and torch.equal(out[TARGET_TOPK_LOGPROBS], logprobs)
    assert torch.equal(out[TOKEN_IDS], token_ids)
    tol = 0.04 if storage == "fp8" else 0.0
    assert float((out[HIDDEN_STATES] - states).norm() / states.norm()) <= tol
    part = load_hidden_states(path, storage_options=backend.storage_options, token_range=(40, 90), layer_ids=[6, 2])
    assert torch.equal(part[TARGET_TOPK_IDS], ids[40:90]) and torch.equal(part[TARGET_TOPK_LOGPROBS], logprobs[40:90])
    assert torch.equal(part[HIDDEN_STATES], out[HIDDEN_STATES][40:90][:, [2, 0]])
    assert verify_hidden_states(path, storage_options=backend.storage_options).top_k == K


def test_the_connector_refuses_missing_or_misshapen_target_rows(tmp_path, connector_factory):
    connector = connector_factory(str(tmp_path), topk_spec())
    connector.start_request(RequestInfo("r", 4, {}))
    ids, logprobs = topk_rows(4)
    with pytest.raises(ValueError, match=r"got extra rows \[\], but the spec's files carry \['target_topk_ids', "
                                         r"'target_topk_logprobs'\] \(target 'top_k:8'\)"):
        connector.save_hidden_states("r", torch.arange(4), torch.randn(4, 3, 32))
    with pytest.raises(ValueError, match=r"target_topk_ids is torch.int64 \[4, 8\], expected torch.int32 \[4, 8\]"):
        connector.save_hidden_states("r", torch.arange(4), torch.randn(4, 3, 32),
                                     {TARGET_TOPK_IDS: ids.long(), TARGET_TOPK_LOGPROBS: logprobs})
    plain = connector_factory(str(tmp_path / "plain"), make_spec())
    plain.start_request(RequestInfo("p", 4, {}))
    with pytest.raises(ValueError, match=r"carry none \(target 'states'\)"):
        plain.save_hidden_states("p", torch.arange(4), torch.randn(4, 3, 32),
                                 {TARGET_TOPK_IDS: ids, TARGET_TOPK_LOGPROBS: logprobs})


def test_a_non_finite_log_probability_fails_its_request_and_nothing_is_written(tmp_path, connector_factory):
    connector = connector_factory(str(tmp_path), topk_spec())
    ids, logprobs = topk_rows(50)
    logprobs[37, 2] = float("nan")
    path = save(connector, "bad", torch.arange(50), torch.randn(50, 3, 32), ids, logprobs)
    failures = connector.wait_for_save()
    assert isinstance(failures["bad"], BadStates)
    assert "non-finite target log-probability (nan) at token 37, rank 2; nothing was written" in str(failures["bad"])
    assert not (tmp_path / path.rsplit("/", 1)[-1]).exists()


def _file_with(tmp_path, tensors: dict, metadata: dict | None) -> str:
    entries = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    data = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors.values())
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(encode_header(entries, metadata) + data)
    return str(path)


@pytest.mark.parametrize("change, said", [
    (lambda t, m: t.pop(TARGET_TOPK_LOGPROBS), "come together; the file has one of them"),
    (lambda t, m: t.update({TARGET_TOPK_IDS: t[TARGET_TOPK_IDS].long()}), "expected int32 and float32 [5, K]"),
    (lambda t, m: t.update({TARGET_TOPK_LOGPROBS: t[TARGET_TOPK_LOGPROBS][:, :3]}), "expected int32 and float32"),
    (lambda t, m: t.update({TARGET_TOPK_IDS: t[TARGET_TOPK_IDS][:4], TARGET_TOPK_LOGPROBS: t[TARGET_TOPK_LOGPROBS][:4]}),
     "expected int32 and float32 [5, K]"),
    (lambda t, m: m.update(target="top_k:4"), "metadata says target 'top_k:4' but the file holds top-8 tensors"),
    (lambda t, m: m.pop("target"), "metadata says target 'states' but the file holds top-8 tensors"),
])
def test_hostile_topk_headers_are_refused_naming_the_problem(tmp_path, change, said):
    spec = topk_spec()
    ids, logprobs = topk_rows(5)
    tensors = {TOKEN_IDS: torch.arange(5), HIDDEN_STATES: torch.randn(5, 3, 32), TARGET_TOPK_IDS: ids,
               TARGET_TOPK_LOGPROBS: logprobs}
    metadata = spec.to_metadata()
    assert load_hidden_states(_file_with(tmp_path, dict(tensors), dict(metadata)))[TARGET_TOPK_IDS].shape == (5, K)
    change(tensors, metadata)
    with pytest.raises(HiddenStatesFileError, match=re.escape(said)):
        load_hidden_states(_file_with(tmp_path, tensors, metadata))


def test_verify_finds_a_non_finite_log_probability_in_a_file_written_without_the_check(tmp_path, connector_factory):
    connector = connector_factory(str(tmp_path), topk_spec(), check_states=False)
    ids, logprobs = topk_rows(20)
    logprobs[11, 5] = -math.inf
    path = save(connector, "inf", torch.arange(20), torch.randn(20, 3, 32), ids, logprobs)
    assert connector.wait_for_save() == {}
    with pytest.raises(HiddenStatesFileError, match=r"non-finite values \(NaN or Inf\) at token 11, rank 5 of "
                                                    r"target_topk_logprobs \[T, K\]; the data is intact"):
        verify_hidden_states(path)
