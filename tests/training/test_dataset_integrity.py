"""The training feed trusts no file: damaged data fails its checksum (verify is on by default, also with max_length),
hostile headers and paths that are not files are refused, on the local memory-mapped path and the remote ranged
one (memory://). Runs are written through the real connector; damage is done to their files afterwards."""

from __future__ import annotations

import json
import os
import posixpath
import struct
import uuid

import fsspec
import pytest
import torch
from torch.utils.data import DataLoader

from connectors import HiddenStatesFileError, HiddenStatesSpec
from connectors.header import HEADER_PROBE_BYTES
from harness.runs import random_samples, write_manifest, write_run
from training.dataset import HiddenStatesDataset

SMALL = HiddenStatesSpec(layer_ids=(1, 2, 3), num_hidden_layers=4, hidden_size=8, dtype="bfloat16", model="tiny/x")
# rows of 3 x 256 float32: 40 rows are 120 kB, more than the reader's first probe, so remote reads take byte ranges
LARGE = HiddenStatesSpec(layer_ids=(1, 2, 3), num_hidden_layers=4, hidden_size=256, dtype="float32", model="tiny/x")


def damage(raw: bytes, tensor: str = "hidden_states", count: int = 64) -> bytes:
    """`count` bytes inverted near the end of `tensor` (past any max_length kept below), found with struct + json."""
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8:8 + n])[tensor]["data_offsets"]
    at = 8 + n + end - count
    assert end - begin >= count
    out = bytearray(raw)
    out[at:at + count] = bytes(b ^ 0xFF for b in out[at:at + count])
    return bytes(out)


def run_with_one_damaged_file(root: str, spec: HiddenStatesSpec, **write) -> tuple[list, list[dict]]:
    samples = random_samples(3, spec, seed=3, min_len=40, max_len=40)
    rows = write_run(root, samples, spec, **write)
    fs, base = fsspec.core.url_to_fs(root)
    target = posixpath.join(base, rows[1]["path"])
    fs.pipe_file(target, damage(fs.cat_file(target)))
    return samples, rows


@pytest.fixture(params=["local", "memory"])
def run_root(request, tmp_path) -> str:
    return str(tmp_path / "run") if request.param == "local" else f"memory://integrity-{uuid.uuid4().hex[:8]}/run"


@pytest.mark.parametrize("spec", [SMALL, LARGE], ids=["small files", "files beyond the first read"])
def test_a_damaged_file_fails_its_checksum_by_default_and_its_neighbours_still_read(run_root, spec):
    samples, _ = run_with_one_damaged_file(run_root, spec)
    ds = HiddenStatesDataset(run_root)
    assert torch.equal(ds[0]["hidden_states"], samples[0].hidden_states)
    assert torch.equal(ds[2]["hidden_states"], samples[2].hidden_states)
    with pytest.raises(HiddenStatesFileError, match="checksum mismatch.*the file is damaged: re-extract it"):
        ds[1]


@pytest.mark.parametrize("spec", [SMALL, LARGE], ids=["small files", "files beyond the first read"])
def test_with_max_length_the_whole_file_is_still_verified(run_root, spec):
    samples, _ = run_with_one_damaged_file(run_root, spec)  # the damage is in the last rows
    ds = HiddenStatesDataset(run_root, max_length=4)
    assert torch.equal(ds[0]["hidden_states"], samples[0].hidden_states[:4])
    with pytest.raises(HiddenStatesFileError, match="checksum mismatch"):
        ds[1]


def test_verify_off_reads_a_damaged_file_as_it_is(run_root):
    samples, _ = run_with_one_damaged_file(run_root, LARGE)
    item = HiddenStatesDataset(run_root, verify=False)[1]
    assert torch.equal(item["hidden_states"][:20], samples[1].hidden_states[:20])  # the damage is in the last rows
    assert not torch.equal(item["hidden_states"], samples[1].hidden_states)
    assert LARGE.hidden_size * 3 * 4 * 40 > HEADER_PROBE_BYTES


def test_a_damaged_file_fails_inside_dataloader_workers_with_the_same_error(tmp_path):
    root = str(tmp_path / "run")
    run_with_one_damaged_file(root, SMALL)
    loader = DataLoader(HiddenStatesDataset(root), batch_size=None, num_workers=1)
    with pytest.raises(HiddenStatesFileError, match="checksum mismatch"):
        list(loader)


def replace_file(root: str, rows: list[dict], index: int, make) -> str:
    path = os.path.join(root, rows[index]["path"])
    os.remove(path)
    make(path)
    return path


def test_a_header_claiming_more_rows_than_the_file_holds_is_refused(tmp_path):
    root = str(tmp_path / "run")
    rows = write_run(root, random_samples(2, SMALL, seed=4, min_len=5, max_len=5), SMALL)

    def hostile(path: str) -> None:
        header = json.dumps({"token_ids": {"dtype": "I64", "shape": [10**12], "data_offsets": [0, 8]},
                             "hidden_states": {"dtype": "BF16", "shape": [10**12, 3, 8], "data_offsets": [8, 8]}})
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header.encode() + bytes(8))

    replace_file(root, rows, 1, hostile)
    for ds in (HiddenStatesDataset(root), HiddenStatesDataset(root, verify=False, max_length=2)):
        assert ds[0]["hidden_states"].shape[1:] == (3, 8)  # its neighbour reads
        with pytest.raises(HiddenStatesFileError, match="needs more than the file holds"):
            ds[1]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["fifo", "symlink to /dev/zero"])
def test_a_data_file_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, kind):
    root = str(tmp_path / "run")
    rows = write_run(root, random_samples(2, SMALL, seed=5), SMALL)
    replace_file(root, rows, 0, os.mkfifo if kind == "fifo" else lambda p: os.symlink("/dev/zero", p))
    match = "FIFO" if kind == "fifo" else "character device"
    with pytest.raises(HiddenStatesFileError, match=f"is a {match}.*, not a regular file"):
        HiddenStatesDataset(root)[0]
    # a run without run.json reads its spec from the first file's header: that read refuses it too
    os.remove(os.path.join(root, "run.json"))
    with pytest.raises(HiddenStatesFileError, match=f"is a {match}"):
        HiddenStatesDataset(root)


def test_a_vllm_style_file_without_a_checksum_is_read_with_verify_on(tmp_path):
    import safetensors.torch

    root = str(tmp_path / "run")
    samples = random_samples(2, SMALL, seed=6, with_mask_every=99)
    rows = write_run(root, samples, SMALL)
    s = samples[1]
    replace_file(root, rows, 1, lambda p: safetensors.torch.save_file(
        {"token_ids": s.token_ids, "hidden_states": s.hidden_states}, p))
    with pytest.raises(ValueError, match="records checksum None, the manifest row xxh3_64"):
        HiddenStatesDataset(root)[1]  # its manifest row commits the checksummed file it replaced
    write_manifest(root, [{**r, "checksum": None} for r in rows])  # as a run of vLLM's files records them
    assert torch.equal(HiddenStatesDataset(root)[1]["hidden_states"], s.hidden_states)


def _expected_tokens(sample, max_length=None):
    ids = sample.token_ids[:max_length]
    mask = sample.loss_mask[:max_length].to(torch.long) if sample.loss_mask is not None else torch.ones_like(ids)
    return ids, mask


@pytest.mark.parametrize("max_length", [None, 4])
def test_token_items_read_tokens_and_masks_without_the_states(run_root, max_length):
    """A tokens-only pass (EAGLE-3's draft vocabulary) reads every sample's ids and mask, also where a file's states
    are damaged: it neither reads nor hashes them; reading that item itself still fails its checksum."""
    samples, _ = run_with_one_damaged_file(run_root, LARGE)
    ds = HiddenStatesDataset(run_root, max_length=max_length)
    got = list(ds.token_items(threads=2))
    assert len(got) == len(samples)
    for item, sample in zip(got, samples):
        ids, mask = _expected_tokens(sample, max_length)
        assert torch.equal(item["input_ids"], ids) and torch.equal(item["loss_mask"], mask)
        assert set(item) == {"input_ids", "loss_mask"}
    with pytest.raises(HiddenStatesFileError, match="checksum mismatch"):
        ds[1]


def test_token_items_fetch_a_small_share_of_a_remote_run(monkeypatch):
    """On a remote run the pass fetches each file's header probe and its two small tensors, not the hidden states
    (files of 400 x 3 x 256 float32 = 1.2 MB, the probe is 64 KiB)."""
    from fsspec.implementations.memory import MemoryFileSystem

    root = f"memory://tokens-{uuid.uuid4().hex[:8]}/run"
    samples = random_samples(10, LARGE, seed=5, min_len=400, max_len=400)
    write_run(root, samples, LARGE)
    fetched = []  # bytes of data files returned; memory://'s cat_ranges reads through cat_file
    cat_file = MemoryFileSystem.cat_file

    def spy(self, path, start=None, end=None, **kw):
        out = cat_file(self, path, start=start, end=end, **kw)
        fetched.append(len(out) if "/data/" in path else 0)
        return out

    monkeypatch.setattr(MemoryFileSystem, "cat_file", spy)
    ds = HiddenStatesDataset(root)
    got = list(ds.token_items(threads=1))  # windows of 8 reads: 10 samples take two
    assert [i["input_ids"].tolist() for i in got] == [s.token_ids.tolist() for s in samples]
    states_bytes = sum(s.hidden_states.numel() * 4 for s in samples)
    assert 0 < sum(fetched) <= len(samples) * (HEADER_PROBE_BYTES + 400 * 9), (sum(fetched), states_bytes)
    assert sum(fetched) < states_bytes / 10
