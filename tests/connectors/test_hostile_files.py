"""Files that lie: every read mode refuses them with the one error type, HiddenStatesFileError, naming the problem.

The files are built by hand (struct + json, never the writer under test): headers that claim more data than the file
holds, negative or fractional shapes, overlapping or gapped offsets, non-string metadata, JSON nested past Python's
recursion limit; and paths that are not files at all (a FIFO, a symlink to /dev/zero, a directory). Each read mode
is tried: a whole load, a token range, a layer subset, the header alone, and a full verification; the remote code
path runs on memory://.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import uuid

import fsspec
import pytest
import torch

from connectors import (
    HiddenStatesFileError,
    load_hidden_states,
    read_hidden_states_info,
    verify_hidden_states,
)

READS = {
    "whole": lambda p: load_hidden_states(p, wait_timeout=1),
    "token range": lambda p: load_hidden_states(p, token_range=(0, 4), wait_timeout=1),
    "layer subset": lambda p: load_hidden_states(p, layer_indices=[0], wait_timeout=1),
    "verified token range": lambda p: load_hidden_states(p, token_range=(0, 4), verify=True, wait_timeout=1),
    "header only": lambda p: read_hidden_states_info(p, wait_timeout=1),
    "verify": lambda p: verify_hidden_states(p, wait_timeout=1),
}
read_modes = pytest.mark.parametrize("read", READS.values(), ids=READS.keys())


def file_bytes(header: dict | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors-shaped file: 8-byte little-endian header length (the real one unless `length`), header, data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def tensor(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def valid_header(t: int = 4, layers: int = 2, hidden: int = 3) -> tuple[dict, bytes]:
    """A correct hidden-states header (int64 ids, f32 states) and its data: the baseline each case breaks."""
    ids, states = 8 * t, 4 * t * layers * hidden
    header = {"token_ids": tensor("I64", [t], 0, ids),
              "hidden_states": tensor("F32", [t, layers, hidden], ids, ids + states)}
    data = torch.arange(t, dtype=torch.int64).numpy().tobytes() + torch.ones(t * layers * hidden).numpy().tobytes()
    return header, data


def write(tmp_path, data: bytes, name: str = "hostile.safetensors") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_the_valid_baseline_loads_in_every_read_mode(tmp_path):
    header, data = valid_header()
    path = write(tmp_path, file_bytes(header, data))
    for name, read in READS.items():
        assert read(path) is not None, name
    assert torch.equal(load_hidden_states(path)["token_ids"], torch.arange(4))


@read_modes
def test_a_200_byte_file_claiming_a_trillion_rows_is_refused(tmp_path, read):
    # the offsets span what the file holds; the shape claims 10^12 rows of 3 x 64 f32
    header = {"token_ids": tensor("I64", [10**12], 0, 8),
              "hidden_states": tensor("F32", [10**12, 3, 64], 8, 8)}
    raw = json.dumps(header).encode()
    path = write(tmp_path, file_bytes(header, b"\0" * (200 - 8 - len(raw))))
    with pytest.raises(HiddenStatesFileError, match="needs more than the file holds"):
        read(path)


@read_modes
def test_offsets_pointing_past_the_end_of_the_file_are_refused(tmp_path, read):
    header = {"token_ids": tensor("I64", [10**12], 0, 8 * 10**12),
              "hidden_states": tensor("F32", [10**12, 3, 64], 8 * 10**12, 8 * 10**12 + 768 * 10**12)}
    path = write(tmp_path, file_bytes(header, b"\0" * 64))
    with pytest.raises(HiddenStatesFileError, match=r"ends at byte \d+ but the file has \d+ bytes"):
        read(path)


@read_modes
def test_a_negative_shape_is_refused_rather_than_giving_minus_one_tokens(tmp_path, read):
    header = {"token_ids": tensor("I64", [-1], 0, 0), "hidden_states": tensor("F32", [-1, 3, 64], 0, 0)}
    path = write(tmp_path, file_bytes(header))
    with pytest.raises(HiddenStatesFileError, match=r"shape \[-1\].*non-negative integers"):
        read(path)


@read_modes
def test_json_nested_past_the_recursion_limit_is_refused_without_recursion_error(tmp_path, read):
    path = write(tmp_path, file_bytes(b"[" * 200_000 + b"]" * 200_000))
    with pytest.raises(HiddenStatesFileError, match="nested too deeply"):
        read(path)


@read_modes
def test_overlapping_tensors_are_refused(tmp_path, read):
    header, data = valid_header()
    header["hidden_states"]["data_offsets"] = [16, 16 + 96]  # starts inside token_ids [0, 32)
    path = write(tmp_path, file_bytes(header, data[:16 + 96]))
    with pytest.raises(HiddenStatesFileError, match="overlaps the tensor before it"):
        read(path)


@read_modes
def test_metadata_that_is_not_strings_is_refused(tmp_path, read):
    header, data = valid_header()
    header["__metadata__"] = {"format": "hsx.hidden_states", "num_tokens": 4}
    path = write(tmp_path, file_bytes(header, data))
    with pytest.raises(HiddenStatesFileError, match="__metadata__ must map strings to strings"):
        read(path)


def _break(change):
    def make() -> bytes:
        header, data = valid_header()
        return change(header, data)
    return make


def _set(name: str, key: str, value):
    def change(header, data):
        header[name][key] = value
        return file_bytes(header, data)
    return change


def _with(extra: dict, data_extra: bytes = b""):
    def change(header, data):
        header.update(extra)
        return file_bytes(header, data + data_extra)
    return change


MALFORMED = {
    "not json": (lambda: file_bytes(b"{not json"), "is not valid JSON"),
    "not utf-8": (lambda: file_bytes(b'{"\xff": 1}'), "is not valid JSON"),
    "an int too long to convert": (lambda: file_bytes(b'{"a": ' + b"9" * 5000 + b"}"), "is not valid JSON"),
    "a json array": (lambda: file_bytes(b"[1, 2, 3]"), "is a JSON list, not an object"),
    "a tensor that is a number": (_break(_with({"hidden_states": 5})), "described by a JSON int, not an object"),
    "an unknown dtype": (_break(_set("hidden_states", "dtype", "F99")), "dtype 'F99', which hsx cannot read"),
    "a missing dtype": (_break(_set("hidden_states", "dtype", None)), "dtype None"),
    "a fractional shape": (_break(_set("hidden_states", "shape", [4, 2.0, 3])), "non-negative integers"),
    "a boolean shape": (_break(_set("token_ids", "shape", [True])), "non-negative integers"),
    "a shape that is a string": (_break(_set("token_ids", "shape", "4")), "non-negative integers"),
    "offsets that are strings": (_break(_set("token_ids", "data_offsets", ["0", "32"])), "expected \\[begin, end\\]"),
    "three offsets": (_break(_set("token_ids", "data_offsets", [0, 16, 32])), "expected \\[begin, end\\]"),
    "offsets backwards": (_break(_set("token_ids", "data_offsets", [32, 0])), "0 <= begin <= end"),
    "a shape that disagrees with its offsets": (_break(_set("token_ids", "shape", [3])), "needs 24 bytes, but its "
                                                                                         "data_offsets \\[0, 32\\]"),
    "a gap between tensors": (lambda: file_bytes(
        {"token_ids": tensor("I64", [4], 0, 32), "hidden_states": tensor("F32", [4, 2, 3], 40, 136)}, bytes(136)),
        "leaves 8 bytes unused"),
    "bytes after the last tensor": (_break(_with({}, b"trailing")), "8 unaccounted for"),
    "a file cut short": (_break(lambda header, data: file_bytes(header, data[:-5])), "ends at byte"),
    "no hidden_states": (_break(lambda header, data: file_bytes({"token_ids": header["token_ids"]}, data[:32])),
                         "no 'hidden_states' tensor"),
    "2-d hidden_states": (lambda: file_bytes(
        {"token_ids": tensor("I64", [4], 0, 32), "hidden_states": tensor("F32", [4, 6], 32, 128)}, bytes(128)),
        "expected hidden_states \\[T, L, H\\] and token_ids \\[T\\]"),
    "token_ids of another length": (lambda: file_bytes(
        {"token_ids": tensor("I64", [5], 0, 40), "hidden_states": tensor("F32", [4, 2, 3], 40, 136)}, bytes(136)),
        "found \\[4, 2, 3\\] and \\[5\\]"),
    "a loss mask of another length": (_break(_with({"loss_mask": tensor("U8", [3], 128, 131)}, b"\1\1\1")),
                                      "loss_mask has shape \\[3\\], expected \\[4\\]"),
    "metadata that is a list": (_break(_with({"__metadata__": ["a"]})), "must map strings to strings"),
    "a tensor named twice": (lambda: file_bytes(
        b'{"token_ids": {"dtype": "I64", "shape": [0], "data_offsets": [0, 0]}, "hidden_states": {"dtype": "F32", '
        b'"shape": [0, 1, 1], "data_offsets": [0, 0]}, "hidden_states": {"dtype": "F32", "shape": [0, 1, 1], '
        b'"data_offsets": [0, 0]}}'), "names 'hidden_states' twice"),
    "layer ids that do not match L": (_break(_with({"__metadata__": {"layer_ids": "[1, 2, 3]"}})),
                                      "must list 2 integer ids"),
    "layer ids that are not json": (_break(_with({"__metadata__": {"layer_ids": "[1, 2"}})),
                                    "metadata 'layer_ids' is not valid JSON"),
    "hsx metadata with another row count": (_break(_with({"__metadata__": {
        "format": "hsx.hidden_states", "layer_ids": "[1, 2]", "num_hidden_layers": "4", "hidden_size": "3",
        "dtype": "float32", "num_tokens": "9"}})), "num_tokens '9' but hidden_states holds 4 rows"),
    "hsx metadata with another width": (_break(_with({"__metadata__": {
        "format": "hsx.hidden_states", "layer_ids": "[1, 2]", "num_hidden_layers": "4", "hidden_size": "8",
        "dtype": "float32"}})), "hidden_size 8 and dtype torch.float32, but hidden_states is \\[4, 2, 3\\]"),
    "a malformed checksum": (_break(_with({"__metadata__": {"checksum": "xxh3_64:XYZ"}})),
                             "checksum 'xxh3_64:XYZ' is malformed"),
    "a header longer than the file": (lambda: file_bytes(b"{}", length=10_000), "header length 10000 does not fit"),
    "a header longer than any header": (lambda: file_bytes(b"{}" + bytes(100), length=2**63),
                                        "does not fit a file of"),
    "fewer than 8 bytes": (lambda: b"\1\2\3", "3 bytes is too short for a safetensors file"),
}


@pytest.mark.parametrize("make, match", MALFORMED.values(), ids=MALFORMED.keys())
@read_modes
def test_a_malformed_header_is_refused_naming_the_problem(tmp_path, read, make, match):
    path = write(tmp_path, make())
    with pytest.raises(HiddenStatesFileError, match=match) as err:
        read(path)
    assert err.value.path == path and "re-extract it" in str(err.value)


# -- paths that are not regular files ---------------------------------------------------------------------------


@pytest.mark.timeout(10)
@read_modes
def test_a_fifo_named_safetensors_is_refused_without_blocking(tmp_path, read):
    path = str(tmp_path / "pipe.safetensors")
    os.mkfifo(path)  # no writer: an ordinary open for reading would wait forever
    with pytest.raises(HiddenStatesFileError, match="is a FIFO \\(named pipe\\), not a regular file"):
        read(path)


@pytest.mark.timeout(10)
@read_modes
def test_a_symlink_to_dev_zero_is_refused_instead_of_read_until_memory_runs_out(tmp_path, read):
    path = str(tmp_path / "zero.safetensors")
    os.symlink("/dev/zero", path)
    with pytest.raises(HiddenStatesFileError, match="is a character device, not a regular file.*symlink"):
        read(path)


@read_modes
def test_a_directory_named_safetensors_is_refused(tmp_path, read):
    path = tmp_path / "folder.safetensors"
    path.mkdir()
    with pytest.raises(HiddenStatesFileError, match="is a directory, not a regular file"):
        read(str(path))


@pytest.mark.timeout(10)
def test_a_fifo_planted_as_the_lock_does_not_hang_readers(tmp_path):
    header, data = valid_header()
    path = write(tmp_path, file_bytes(header, data))
    os.mkfifo(path + ".lock")
    assert load_hidden_states(path, wait_timeout=1)["hidden_states"].shape == (4, 2, 3)


# -- the remote code path (memory://) ---------------------------------------------------------------------------


def put_memory(data: bytes) -> str:
    url = f"memory://hostile-{uuid.uuid4().hex[:8]}/file.safetensors"
    fsspec.filesystem("memory").pipe_file(url, data)
    return url


@read_modes
def test_a_remote_file_claiming_a_trillion_rows_is_refused(read):
    header = {"token_ids": tensor("I64", [10**12], 0, 8), "hidden_states": tensor("F32", [10**12, 3, 64], 8, 8)}
    url = put_memory(file_bytes(header, bytes(120)))
    with pytest.raises(HiddenStatesFileError, match="needs more than the file holds") as err:
        read(url)
    assert err.value.path == url


@pytest.mark.parametrize("make, match", [MALFORMED[k] for k in ("a gap between tensors", "a file cut short",
                                                                "a json array", "a header longer than the file")],
                         ids=["gap", "cut short", "json array", "header too long"])
@read_modes
def test_a_malformed_remote_header_is_refused_naming_the_problem(read, make, match):
    with pytest.raises(HiddenStatesFileError, match=match):
        read(put_memory(make()))


def test_a_remote_header_larger_than_the_first_read_is_still_checked():
    # the probe holds only part of a 100 kB header: the reader fetches the rest and checks it all
    header, data = valid_header()
    header["__metadata__"] = {"padding": "x" * 100_000, "bad": 1}
    with pytest.raises(HiddenStatesFileError, match="must map strings to strings"):
        read_hidden_states_info(put_memory(file_bytes(header, data)))


# -- the error itself ---------------------------------------------------------------------------------------------


def test_the_error_is_a_value_error_that_survives_pickling_and_a_one_argument_rebuild(tmp_path):
    path = write(tmp_path, b"\1\2\3")
    with pytest.raises(ValueError) as caught:  # callers that catch ValueError keep working
        read_hidden_states_info(path)
    err = caught.value
    assert isinstance(err, HiddenStatesFileError)
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.path, back.reason, str(back)) == (HiddenStatesFileError, err.path, err.reason, str(err))
    # torch's DataLoader re-raises a worker's error as exc_type(message)
    assert str(HiddenStatesFileError(str(err))) == str(err)
