"""Storage dtypes (issue 25): fp8 hidden states with a float32 scale per token and layer, bf16/fp16 storage of wider
models, read back transparently in the model dtype on every backend; and states that must never be committed (NaN,
Inf, a layer of zeros) fail their request alone, naming the token and layer."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from connectors.example_hidden_states_connector import load_hidden_states, read_hidden_states_info
from connectors.format import HIDDEN_STATES_SCALES, HiddenStatesSpec
from connectors.quant import FP8, FP8_RELATIVE_ERROR, BadStates, check_storage_dtype, dequantize, quantize
from tests.connectors.conftest import make_spec
from tests.connectors.test_storage_contract import HIDDEN, LAYERS, random_request, save_request


def layered_states(num_tokens: int, *, seed: int = 0) -> torch.Tensor:
    """[T, 3, H] float32 whose layers differ in magnitude as a real model's do: an embedding-sized first layer, a
    mid layer, and a pre-norm last layer some 10^4 times the first (massive activations)."""
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(num_tokens, len(LAYERS), HIDDEN, generator=g)
    return states * torch.tensor([0.01, 2.0, 300.0]).view(1, -1, 1)


def relative_rms(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per layer: RMS of the error over RMS of the reference ([T, L, H] -> [L])."""
    return ((got - ref).pow(2).mean(dim=(0, 2)) / ref.pow(2).mean(dim=(0, 2))).sqrt()


def test_fp8_error_per_layer_is_bounded_and_per_layer_scales_keep_small_layers_precise():
    states = layered_states(512)
    stored, scales = quantize(states, FP8)
    assert stored.dtype == torch.float8_e4m3fn and scales.shape == (512, len(LAYERS), 1)
    assert scales.dtype == torch.float32
    back = dequantize(stored, scales, torch.float32)
    error = relative_rms(back, states)
    assert bool((error < 0.04).all()), error  # e4m3 keeps 3 mantissa bits: ~2-3% relative RMS
    worst = ((back - states).abs() / states.abs().amax(dim=-1, keepdim=True)).max()
    assert worst <= FP8_RELATIVE_ERROR + 1e-6
    # one scale per token (speculators' [T, 1, 1]) pushes the small layer into e4m3's subnormals (spacing 2^-9)
    shared = (states.abs().amax(dim=(1, 2), keepdim=True) / 448.0).clamp(min=1e-12)
    coarse = dequantize((states / shared).to(torch.float8_e4m3fn), shared, torch.float32)
    assert relative_rms(coarse, states)[0] > 3 * error[0]  # measured: ~9% against ~2.4%


def test_storage_dtype_names_and_refusal():
    assert check_storage_dtype("fp8") == FP8 and check_storage_dtype("bf16") == "bfloat16"
    assert check_storage_dtype(None) == check_storage_dtype("auto") == "model"
    with pytest.raises(ValueError, match="--storage-dtype 'int4' is not a storage dtype"):
        check_storage_dtype("int4", flag="--storage-dtype")
    # a storage dtype equal to the model dtype is the default one (the files are the same)
    assert HiddenStatesSpec((1,), 2, 8, "bfloat16", storage_dtype="bfloat16").storage_dtype == ""


def test_fp8_round_trip_on_every_backend_reads_back_in_the_model_dtype(backend, connector_factory):
    spec = make_spec(torch.float32, LAYERS, HIDDEN)
    connector = connector_factory(backend.root, spec, storage_options=backend.storage_options, storage_dtype="fp8")
    token_ids = torch.arange(300)
    states = layered_states(300, seed=1)
    path = save_request(connector, "fp8-1", token_ids, states, chunks=4)
    assert connector.wait_for_save() == {}

    info = read_hidden_states_info(path, storage_options=backend.storage_options)
    assert info.dtype == torch.float8_e4m3fn and info.tensors[HIDDEN_STATES_SCALES].shape == (300, 3, 1)
    assert info.metadata["storage_dtype"] == FP8 and info.metadata["dtype"] == "float32"
    out = load_hidden_states(path, storage_options=backend.storage_options, verify=True)
    assert HIDDEN_STATES_SCALES not in out and out["hidden_states"].dtype == torch.float32
    assert torch.equal(out["token_ids"], token_ids)
    assert bool((relative_rms(out["hidden_states"], states) < 0.04).all())
    raw = load_hidden_states(path, storage_options=backend.storage_options, dequantize=False)
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize(raw["hidden_states"], raw[HIDDEN_STATES_SCALES], torch.float32),
                       out["hidden_states"])
    as_bf16 = load_hidden_states(path, storage_options=backend.storage_options, dtype=torch.bfloat16)
    assert as_bf16["hidden_states"].dtype == torch.bfloat16

    # partial reads of an fp8 file read only their rows' (and layers') scales and give the same values
    part = load_hidden_states(path, storage_options=backend.storage_options, token_range=(40, 90), layer_ids=[6, 2])
    assert torch.equal(part["hidden_states"], out["hidden_states"][40:90][:, [2, 0]])
    assert torch.equal(part["token_ids"], token_ids[40:90])


def test_fp8_files_are_about_half_of_bf16_and_bf16_storage_of_an_fp32_model_is_exact_to_bf16(tmp_path,
                                                                                          connector_factory):
    spec = make_spec(torch.float32, LAYERS, 1024)
    token_ids = torch.arange(512)
    states = torch.randn(512, len(LAYERS), 1024)
    sizes = {}
    for storage in ("bfloat16", FP8):
        connector = connector_factory(str(tmp_path / storage), spec, storage_dtype=storage)
        path = save_request(connector, "r", token_ids, states)
        assert connector.wait_for_save() == {}
        sizes[storage] = read_hidden_states_info(path).size
        if storage == "bfloat16":
            out = load_hidden_states(path)
            assert out["hidden_states"].dtype == torch.float32  # the model dtype, as the spec records
            assert torch.equal(out["hidden_states"], states.to(torch.bfloat16).float())
    # per token: L*H bytes + 4 bytes of scale per layer + the 8-byte token id, against 2*L*H + 8 (at H = 4096: 0.500)
    assert sizes[FP8] / sizes["bfloat16"] <= 0.51, sizes


def test_a_speculators_style_fp8_file_with_one_scale_per_token_loads(tmp_path):
    states = layered_states(20, seed=2)
    scales = (states.abs().amax(dim=(1, 2), keepdim=True) / 448.0).clamp(min=1e-12)  # [T, 1, 1]
    path = str(tmp_path / "hs_0.safetensors")
    safetensors.torch.save_file({"hidden_states": (states / scales).to(torch.float8_e4m3fn),
                                 "hidden_states_scales": scales, "token_ids": torch.arange(20)}, path)
    out = load_hidden_states(path)
    assert out["hidden_states"].dtype == torch.float32  # no hsx metadata: float32, unless asked otherwise
    expected = (states / scales).to(torch.float8_e4m3fn).float() * scales
    assert torch.equal(out["hidden_states"], expected)
    part = load_hidden_states(path, token_range=(5, 9), layer_indices=[2])
    assert torch.equal(part["hidden_states"], expected[5:9][:, [2]])
    assert load_hidden_states(path, dtype=torch.bfloat16)["hidden_states"].dtype == torch.bfloat16


def test_scales_of_the_wrong_shape_are_refused_naming_the_fix(tmp_path):
    path = str(tmp_path / "bad.safetensors")
    safetensors.torch.save_file({"hidden_states": torch.zeros(4, 2, 8).to(torch.float8_e4m3fn),
                                 "hidden_states_scales": torch.ones(4, 8), "token_ids": torch.arange(4)}, path)
    with pytest.raises(ValueError, match=r"hidden_states_scales is torch.float32 \[4, 8\]; expected float32 "
                                         r"\[4, 2, 1\] \(per token and layer\) or \[4, 1, 1\]"):
        load_hidden_states(path)


@pytest.mark.parametrize("plant, said", [
    ("nan", "non-finite value (nan) at token 7, layer 1 (hidden-state id 4)"),
    ("inf", "non-finite value (inf) at token 150, layer 2 (hidden-state id 6)"),
    ("zeros", "layer 0 (hidden-state id 2) is all zeros over all 200 tokens"),
])
@pytest.mark.parametrize("storage", ["model", FP8])
def test_bad_states_fail_their_request_alone_and_nothing_is_written(plant, said, storage, tmp_path,
                                                                   connector_factory):
    connector = connector_factory(str(tmp_path / "run"), make_spec(torch.float32, LAYERS, HIDDEN),
                                  storage_dtype=storage)
    token_ids, good = random_request(200, torch.float32, seed=3)
    bad = good.clone()
    if plant == "nan":
        bad[7, 1, 5] = float("nan")
    elif plant == "inf":
        bad[150, 2, 0] = float("inf")
    else:
        bad[:, 0] = 0.0
    bad_path = save_request(connector, "bad", token_ids, bad, chunks=4)
    good_path = save_request(connector, "good", token_ids, good, chunks=4)
    failures = connector.wait_for_save()
    assert list(failures) == ["bad"] and isinstance(failures["bad"], BadStates)
    assert said in str(failures["bad"]) and "nothing was written" in str(failures["bad"])
    assert not (tmp_path / "run" / bad_path.rsplit("/", 1)[-1]).exists()
    assert load_hidden_states(good_path)["hidden_states"].shape == (200, 3, HIDDEN)


def test_zeros_over_one_repeated_token_are_the_models_own_and_are_written(tmp_path, connector_factory):
    """A padding_idx embedding row is zero, and a bias-free decoder keeps that token zero in every layer: a sample of
    that one token is zero by right (zeros across different tokens are what a capture that never ran leaves)."""
    connector = connector_factory(str(tmp_path / "run"), make_spec(torch.float32, LAYERS, HIDDEN))
    path = save_request(connector, "pad", torch.zeros(3, dtype=torch.long), torch.zeros(3, len(LAYERS), HIDDEN),
                        chunks=1)
    assert connector.wait_for_save() == {}
    assert not load_hidden_states(path)["hidden_states"].any()
