"""Checksums: every file the connector writes records xxh3_64 of its data, and readers that are asked to verify it
catch damage.

The oracle is xxhash itself over the file's bytes after the header, found with struct + json, not the reader's code.
Damage is done to real connector-written files: 64 bytes flipped inside one tensor.
"""

from __future__ import annotations

import json
import struct
import uuid

import pytest
import safetensors.torch
import torch
import xxhash

from connectors import (
    HiddenStatesFileError,
    RequestInfo,
    load_hidden_states,
    read_hidden_states_info,
    verify_hidden_states,
)
from connectors.header import file_entries, file_size, request_metadata
from tests.connectors.conftest import make_spec

LAYERS = (2, 4, 6)
HIDDEN = 32


def states_of(num_tokens: int, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 50_000, (num_tokens,), generator=g),
            torch.randn(num_tokens, len(LAYERS), HIDDEN, generator=g).to(dtype))  # [T], [T, L, H]


def write_one(connector, request_id: str, token_ids, states, *, loss_mask=None, sample_id=None) -> str:
    """One request through the connector in three chunks, as an engine feeds it; the path, once durable."""
    connector.start_request(RequestInfo(request_id, token_ids.shape[0], {}, sample_id=sample_id, loss_mask=loss_mask))
    for ids, rows in zip(token_ids.tensor_split(3), states.tensor_split(3)):
        connector.save_hidden_states(request_id, ids, rows)
    path = connector.request_finished(request_id)["hidden_states_path"]
    assert connector.wait_for_save() == {}
    return path


def split(raw: bytes) -> tuple[dict, bytes]:
    """(header JSON, data bytes) of a safetensors file, parsed independently of hsx."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def flip(path: str, tensor: str, count: int = 64) -> None:
    """Invert `count` bytes in the middle of `tensor`'s data, in place."""
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8:8 + n])[tensor]["data_offsets"]
    at = 8 + n + (begin + end - count) // 2
    assert end - begin >= count
    raw[at:at + count] = bytes(b ^ 0xFF for b in raw[at:at + count])
    with open(path, "wb") as f:
        f.write(raw)


def test_the_written_checksum_is_xxh3_64_of_the_bytes_after_the_header(backend, connector_factory):
    connector = connector_factory(backend.root, make_spec(torch.bfloat16, LAYERS, HIDDEN),
                                  storage_options=backend.storage_options)
    token_ids, states = states_of(37, seed=1)
    mask = (torch.arange(37) % 3 == 0).to(torch.uint8)
    path = write_one(connector, "req-1", token_ids, states, loss_mask=mask)

    header, data = split(backend.fs.cat_file(backend.key(path)))
    expected = f"xxh3_64:{xxhash.xxh3_64(data).hexdigest()}"
    assert header["__metadata__"]["checksum"] == expected
    assert read_hidden_states_info(path, storage_options=backend.storage_options).checksum == expected
    assert len(data) == 37 * 8 + states.numel() * 2 + 37  # token_ids, hidden_states, loss_mask: all hashed


def test_checksums_of_different_data_differ_and_an_empty_request_has_one_too(tmp_path, connector_factory):
    connector = connector_factory(str(tmp_path), make_spec(torch.bfloat16, LAYERS, HIDDEN))
    a = write_one(connector, "a", *states_of(5, seed=1))
    b = write_one(connector, "b", *states_of(5, seed=2))
    connector.start_request(RequestInfo("empty", 0))
    empty = connector.request_finished("empty")["hidden_states_path"]
    assert connector.wait_for_save() == {}
    checksums = [read_hidden_states_info(p).checksum for p in (a, b, empty)]
    assert len(set(checksums)) == 3
    assert checksums[2] == f"xxh3_64:{xxhash.xxh3_64(b'').hexdigest()}"


def test_file_size_predicts_the_written_file_to_the_byte_checksum_included(tmp_path, connector_factory):
    spec = make_spec(torch.bfloat16, LAYERS, HIDDEN)
    connector = connector_factory(str(tmp_path), spec)
    token_ids, states = states_of(21, seed=3)
    path = write_one(connector, "sized", token_ids, states, loss_mask=torch.ones(21, dtype=torch.uint8),
                     sample_id="sämple/ü")
    metadata = request_metadata(spec.to_metadata(), request_id="sized", num_tokens=21, num_prompt_tokens=21,
                                include_output_tokens=False, sample_id="sämple/ü")
    with open(path, "rb") as f:
        written = f.read()
    assert file_size(file_entries(spec, 21, loss_mask=True), metadata) == len(written)
    assert list(split(written)[0]["__metadata__"]) == list(metadata)  # same keys, same order: the same layout


@pytest.mark.parametrize("tensor", ["token_ids", "hidden_states", "loss_mask"])
def test_64_flipped_bytes_fail_every_verified_read_and_pass_unverified_ones(tmp_path, connector_factory, tensor):
    connector = connector_factory(str(tmp_path), make_spec(torch.bfloat16, LAYERS, HIDDEN))
    token_ids, states = states_of(100, seed=4)
    path = write_one(connector, "damaged", token_ids, states, loss_mask=torch.ones(100, dtype=torch.uint8))
    intact = load_hidden_states(path, verify=True)
    assert torch.equal(intact["hidden_states"], states) and torch.equal(intact["token_ids"], token_ids)
    recorded = verify_hidden_states(path).checksum

    flip(path, tensor)
    for read in (lambda: load_hidden_states(path, verify=True),
                 lambda: load_hidden_states(path, token_range=(0, 2), verify=True),  # rows far from the damage
                 lambda: load_hidden_states(path, layer_ids=[4], verify=True),
                 lambda: verify_hidden_states(path)):
        with pytest.raises(HiddenStatesFileError, match="checksum mismatch.*the file is damaged: re-extract it"):
            read()
    damaged = load_hidden_states(path)  # verify=False: read as it is
    assert not torch.equal(damaged[tensor], intact[tensor])
    assert read_hidden_states_info(path).checksum == recorded  # the header is intact: only the data was hit


def test_a_damaged_remote_file_fails_verified_reads(connector_factory):
    import fsspec

    root = f"memory://checksum-{uuid.uuid4().hex[:8]}/run"
    connector = connector_factory(root, make_spec(torch.bfloat16, LAYERS, HIDDEN))
    path = write_one(connector, "remote", *states_of(50, seed=5))
    fs = fsspec.filesystem("memory")
    key = fs._strip_protocol(path)
    raw = bytearray(fs.cat_file(key))
    raw[-40] ^= 0x01  # one bit in the last rows of hidden_states
    fs.pipe_file(key, bytes(raw))
    for read in (lambda: load_hidden_states(path, verify=True),
                 lambda: load_hidden_states(path, token_range=(0, 2), verify=True),
                 lambda: verify_hidden_states(path)):
        with pytest.raises(HiddenStatesFileError, match="checksum mismatch"):
            read()
    assert load_hidden_states(path, token_range=(0, 2))["token_ids"].shape == (2,)


def test_a_vllm_style_file_without_metadata_has_nothing_to_verify_and_loads(tmp_path):
    token_ids, states = states_of(12, seed=6)
    path = str(tmp_path / "vllm.safetensors")
    safetensors.torch.save_file({"token_ids": token_ids, "hidden_states": states}, path)
    assert read_hidden_states_info(path).checksum is None
    got = load_hidden_states(path, verify=True)
    assert torch.equal(got["hidden_states"], states)
    assert verify_hidden_states(path).checksum is None


def test_a_checksum_of_an_unknown_algorithm_fails_verification_and_says_how_to_read_anyway(tmp_path):
    token_ids, states = states_of(4, seed=7)
    path = str(tmp_path / "future.safetensors")
    safetensors.torch.save_file({"token_ids": token_ids, "hidden_states": states}, path,
                                metadata={"checksum": "blake3:00"})
    with pytest.raises(HiddenStatesFileError, match="algorithm this hsx does not know.*verify=False"):
        load_hidden_states(path, verify=True)
    assert torch.equal(load_hidden_states(path)["hidden_states"], states)


@pytest.mark.parametrize("bad, where", [(float("nan"), (5, 1)), (float("inf"), (0, 0)), (float("-inf"), (99, 2))])
def test_non_finite_values_are_reported_by_token_and_layer(tmp_path, connector_factory, bad, where):
    # files written without the commit check (vLLM's, an older hsx's): the reader still finds the NaN
    connector = connector_factory(str(tmp_path), make_spec(torch.float16, LAYERS, HIDDEN), check_states=False)
    token_ids, states = states_of(100, seed=8, dtype=torch.float16)
    t, layer = where
    states[t, layer, 7] = bad
    states[t + 1:, :, :3] = float("nan")  # later ones are not the first
    path = write_one(connector, "nan", token_ids, states)
    with pytest.raises(HiddenStatesFileError, match=rf"non-finite values \(NaN or Inf\) at token {t}, layer {layer} "
                                                    rf"\(hidden-state id {LAYERS[layer]}\).*checksum matches"):
        verify_hidden_states(path)
    got = load_hidden_states(path, verify=True)["hidden_states"]  # intact data: a verified load returns it as is
    assert torch.equal(got.isfinite(), states.isfinite()) and torch.equal(got.nan_to_num(), states.nan_to_num())


def test_verify_streams_large_files_in_blocks_and_finds_the_damage(tmp_path, connector_factory, monkeypatch):
    from connectors import reader

    monkeypatch.setattr(reader, "SCAN_BLOCK_BYTES", 1000)  # many blocks of whole rows for a small file
    connector = connector_factory(str(tmp_path), make_spec(torch.float32, LAYERS, HIDDEN), check_states=False)
    token_ids, states = states_of(64, seed=9, dtype=torch.float32)
    states[50, 2, 0] = float("nan")
    path = write_one(connector, "blocks", token_ids, states)
    with pytest.raises(HiddenStatesFileError, match="at token 50, layer 2"):
        verify_hidden_states(path)
    flip(path, "token_ids", count=8)
    with pytest.raises(HiddenStatesFileError, match="checksum mismatch"):  # damage is reported before any NaN
        verify_hidden_states(path)
