"""Storage dtypes (issue 25): fp8 hidden states with a float32 scale per token and layer, bf16/fp16 storage of wider
models, read back transparently in the model dtype on every backend; and states that must never be committed (NaN,
Inf, a layer of zeros) fail their request alone, naming the token and layer."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from connectors.example_hidden_states_connector import load_hidden_states, read_hidden_states_info
from connectors.format import FP8, HIDDEN_STATES_SCALES, HiddenStatesSpec, check_storage_dtype
from connectors.quant import FP8_RELATIVE_ERROR, BadStates, dequantize, quantize
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


def _within_fp8(got: torch.Tensor, original: torch.Tensor) -> None:
    """[t, l, H] states within fp8's rounding of the originals: per token and layer, FP8_RELATIVE_ERROR of the
    row's largest magnitude."""
    err = (got - original).abs().amax(-1)
    assert bool((err <= FP8_RELATIVE_ERROR * original.abs().amax(-1) * 1.001).all())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, comparable with torch.equal (float8 has no equality of its own on CPU)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_remote_fp8_reads_equal_the_same_reads_from_local_disk_and_a_token_range_fetches_only_its_rows(
        remote_backend, connector_factory, tmp_path):
    """An fp8 file on an object store (behind a metering proxy) read whole, by a layer subset, and by a token range
    with a layer subset: each equal, bit for bit, to the same read of the same bytes on local disk, and within fp8's
    error of the states written. A token range fetches the header and its rows only — token ids, the fp8 rows (all
    L layers of a row: they are contiguous) and those rows' scales. A layer subset of every token is strided through
    the file, so it is one whole-file GET, never more."""
    import re

    from connectors.header import HEADER_PROBE_BYTES
    from harness.http_proxy import LoopbackProxy

    num_tokens, first, last = 2048, 1500, 1600
    connector = connector_factory(remote_backend.root, make_spec(torch.float32, LAYERS, HIDDEN),
                                  storage_options=remote_backend.storage_options, storage_dtype="fp8")
    token_ids, states = torch.arange(num_tokens), layered_states(num_tokens, seed=4)
    url = save_request(connector, "fp8-remote", token_ids, states, chunks=4)
    assert connector.wait_for_save() == {}
    local = str(tmp_path / "copy.safetensors")
    with open(local, "wb") as f:
        f.write(remote_backend.fs.cat_file(remote_backend.key(url)))
    info = read_hidden_states_info(local)
    size = info.size
    assert size > 2 * HEADER_PROBE_BYTES  # large enough that a token range is read by byte ranges
    row_spans = [(e.start + first * e.row_bytes, e.start + last * e.row_bytes) for e in info.tensors.values()]
    assert {e.name for e in info.tensors.values()} == {"token_ids", "hidden_states", HIDDEN_STATES_SCALES}

    reads = {"whole": {}, "layers": {"layer_ids": [6, 2]},
             "range+layers": {"token_range": (first, last), "layer_ids": [4]}}
    expected = {"whole": states, "layers": states[:, [2, 0]], "range+layers": states[first:last, [1]]}
    fetched = {}
    with LoopbackProxy(remote_backend.endpoint) as proxy:
        options = remote_backend.options_via(proxy.endpoint)
        for name, kwargs in reads.items():
            proxy.reset_log()
            remote = load_hidden_states(url, storage_options=options, **kwargs)
            fetched[name] = (proxy.body_bytes_sent, [e.range for e in proxy.log if e.method == "GET"])
            stored = load_hidden_states(url, storage_options=options, dequantize=False, **kwargs)
            on_disk = load_hidden_states(local, **kwargs)
            stored_on_disk = load_hidden_states(local, dequantize=False, **kwargs)
            assert remote.keys() == on_disk.keys() and all(torch.equal(remote[k], on_disk[k]) for k in remote), name
            assert stored.keys() == stored_on_disk.keys() and all(
                torch.equal(_bits(stored[k]), _bits(stored_on_disk[k])) for k in stored), name
            assert remote["hidden_states"].dtype == torch.float32
            assert stored[HIDDEN_STATES_SCALES].shape == (*expected[name].shape[:2], 1)  # only the layers' scales
            _within_fp8(remote["hidden_states"], expected[name])
            assert torch.equal(remote["token_ids"], token_ids[first:last] if "token_range" in kwargs else token_ids)

    needed = sum(b - a for a, b in row_spans)
    slack = 8192  # JSON object metadata (gcs answers several metadata GETs)
    assert size <= fetched["whole"][0] <= size + slack  # the file once
    assert size <= fetched["layers"][0] <= size + slack  # the file once, whole
    range_bytes, range_gets = fetched["range+layers"]
    assert needed <= range_bytes <= HEADER_PROBE_BYTES + needed + slack and range_bytes < size // 2
    for header in filter(None, range_gets):
        b, e = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", header).groups())
        assert (b == 0 and e < HEADER_PROBE_BYTES) or any(lo <= b and e < hi for lo, hi in row_spans), \
            f"fetched bytes {b}-{e}, outside the header and the rows asked for"


def _planted(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[300, 3, 64] states in `dtype` with what the bit tricks must get right: -0.0 and all-zero rows, subnormals,
    the dtype's largest value, a row of negatives, NaN, +inf and -inf in rows of their own."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(300, 3, 64, generator=g) * torch.logspace(-6, 4, 300)[:, None, None]).to(dtype)
    info = torch.finfo(dtype)
    x[1, 0] = -0.0
    x[2, 1] = 0.0
    x[3, 2, :5] = info.tiny / 4  # subnormals
    x[4, 0, 7] = info.max
    x[5, 1] = -x[5, 1].abs() - 1
    x[6, 2, 9] = float("nan")
    x[7, 0, 3] = float("inf")
    x[8, 1, 60] = float("-inf")
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_magnitudes_equal_the_float_abs_amax_nan_and_inf_included(dtype, monkeypatch):
    from connectors.quant import row_magnitudes

    monkeypatch.setattr("connectors.quant._BLOCK_BYTES", 4096)  # blocks of a few tokens, the last one short
    x = _planted(dtype, seed=1)
    want = x.float().abs().amax(dim=-1)  # the oracle: the float expression the writer used before
    got = row_magnitudes(x)
    assert got.dtype == dtype and got.shape == (300, 3)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got.float()[finite], want[finite])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_files_bytes_equal_the_whole_tensor_expression(dtype, monkeypatch):
    monkeypatch.setattr("connectors.quant._BLOCK_BYTES", 4096)
    x = _planted(dtype, seed=2)
    x[6:9] = 1.0  # the writer refuses non-finite samples before quantizing
    f = x.float()
    scales = (f.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    want = (f / scales).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    stored, got_scales = quantize(x, FP8)
    assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8)) and torch.equal(got_scales, scales)


@pytest.mark.parametrize("plant", ["nan", "-inf", "zeros"])
def test_the_state_check_finds_what_an_element_scan_finds(plant):
    """The check reads row magnitudes; its findings must be the element-wise scan's: the first non-finite value in
    token, layer, position order, with its value, and a layer of zeros (-0.0 counts as zero)."""
    from connectors.quant import state_problem

    x = torch.randn(40, 3, 16).to(torch.bfloat16)
    if plant == "nan":
        x[30, 2, 4] = float("nan")
        x[31, 0, 0] = float("inf")  # later: not the one named
    elif plant == "-inf":
        x[12, 1, 15] = float("-inf")
    else:
        x[:, 1] = 0.0
        x[::2, 1, 3] = -0.0
    chunks = list(x.split(16))
    said = state_problem(chunks, (2, 4, 6), [torch.arange(len(c)) for c in chunks])
    assert said == {"nan": "non-finite value (nan) at token 30, layer 2 (hidden-state id 6)",
                    "-inf": "non-finite value (-inf) at token 12, layer 1 (hidden-state id 4)",
                    "zeros": "layer 1 (hidden-state id 4) is all zeros over all 40 tokens"}[plant]


@pytest.mark.parametrize("staged", [None, 4096])  # in memory, and through the spool piece by piece
def test_rows_quantized_on_the_device_make_the_same_file_bytes(staged, tmp_path, connector_factory):
    """The engine's device path (extractor.runner: fp8 cast and scales before the copy) hands the connector fp8 rows
    with HIDDEN_STATES_SCALES and ROW_MAGNITUDES: the file's tensors are byte for byte those of the host path, which
    quantizes model-dtype rows itself; a non-finite row is still refused, naming token and layer."""
    from connectors import RequestInfo
    from connectors.quant import ROW_MAGNITUDES, row_magnitudes

    options = {} if staged is None else {"max_staged_bytes_per_request": staged}
    spec = make_spec(torch.bfloat16, LAYERS, HIDDEN)
    host = connector_factory(str(tmp_path / "host"), spec, storage_dtype=FP8, **options)
    device = connector_factory(str(tmp_path / "device"), spec, storage_dtype=FP8, **options)
    token_ids, states = random_request(90, torch.bfloat16, seed=5)
    bad = states.clone()
    bad[61, 2, 7] = float("-inf")
    paths = {}
    for name, rows in (("good", states), ("bad", bad)):
        paths[("host", name)] = save_request(host, name, token_ids, rows, chunks=4)
        device.start_request(RequestInfo(name, token_ids.shape[0], {}))
        for ids, chunk in zip(token_ids.tensor_split(4), rows.tensor_split(4)):
            magnitudes = row_magnitudes(chunk)
            stored, scales = quantize(chunk, FP8, magnitudes)
            device.save_hidden_states(name, ids, stored, {HIDDEN_STATES_SCALES: scales, ROW_MAGNITUDES: magnitudes})
        paths[("device", name)] = device.request_finished(name)["hidden_states_path"]
    host_failures, device_failures = host.wait_for_save(), device.wait_for_save()
    assert list(host_failures) == list(device_failures) == ["bad"]
    assert "non-finite value (-inf) at token 61, layer 2 (hidden-state id 6)" in str(host_failures["bad"])
    assert "non-finite value (magnitude inf) at token 61, layer 2 (hidden-state id 6)" in str(device_failures["bad"])
    a, b = (safetensors.torch.load_file(paths[(k, "good")]) for k in ("host", "device"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    with pytest.raises(ValueError, match="rows quantized on the device must be"):
        device.start_request(RequestInfo("wrong", 2, {}))
        device.save_hidden_states("wrong", token_ids[:2], states[:2].to(torch.float8_e4m3fn),
                                  {HIDDEN_STATES_SCALES: torch.ones(2, 3)})
