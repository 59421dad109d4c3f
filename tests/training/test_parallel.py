"""The dataset on S3 (loopback moto server), in DataLoader workers, and split across distributed ranks."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from connectors import HiddenStatesSpec
from harness.runs import random_samples, write_run
from training.collate import PackCollator, PadCollator
from training.dataset import HiddenStatesDataset
from training.sampler import ShardSampler


@pytest.fixture
def s3_run(s3_bucket):
    url, options = s3_bucket
    spec = HiddenStatesSpec(layer_ids=(1, 3, 4), num_hidden_layers=4, hidden_size=64, dtype="float32",
                            model="tiny/s3")
    # two samples of ~1000 tokens (> 64 KiB: header and byte ranges are separate reads), the rest small
    samples = random_samples(6, spec, seed=4, min_len=3, max_len=30)
    samples += random_samples(2, spec, seed=5, min_len=900, max_len=1000)
    for i, s in enumerate(samples):
        s.sample_id = f"s{i:05d}"
    out = f"{url}/runs/a"
    write_run(out, samples, spec, storage_options=options)
    return out, options, samples


@pytest.mark.s3
def test_an_s3_run_reads_like_a_local_one(s3_run, tmp_path):
    out, options, samples = s3_run
    ds = HiddenStatesDataset(out, storage_options=options, layout="eagle3")
    assert len(ds) == len(samples)
    for i, s in enumerate(samples):
        item = ds[i]
        assert torch.equal(item["input_ids"], s.token_ids)
        assert torch.equal(item["aux_hidden_states"], s.hidden_states[:, :-1].flatten(1))
        assert torch.equal(item["target_hidden_states"], s.hidden_states[:, -1])
    # a token prefix of a large file: only that range is fetched, nothing is written locally
    short = HiddenStatesDataset(out, storage_options=options, max_length=7)
    assert torch.equal(short[7]["hidden_states"], samples[7].hidden_states[:7])
    # whole-file downloads only when asked, into the given folder
    cache = tmp_path / "cache"
    cached = HiddenStatesDataset(out, storage_options=options, cache_dir=str(cache))
    assert torch.equal(cached[6]["hidden_states"], samples[6].hidden_states)
    assert len(os.listdir(cache)) >= 1


@pytest.mark.s3
def test_dataloader_workers_open_s3_lazily(s3_run):
    out, options, samples = s3_run
    ds = HiddenStatesDataset(out, storage_options=options)
    ds[0]  # the parent's filesystem must not travel to the workers
    assert pickle.loads(pickle.dumps(ds))._fs is None
    loader = DataLoader(ds, batch_size=3, num_workers=2, collate_fn=PadCollator(), persistent_workers=False)
    seen = {}
    for batch in loader:
        for b, sid in enumerate(batch["sample_id"]):
            n = int(batch["lengths"][b])
            seen[sid] = (batch["input_ids"][b, :n], batch["hidden_states"][b, :n])
    assert sorted(seen) == [s.sample_id for s in samples]
    for s in samples:
        assert torch.equal(seen[s.sample_id][0], s.token_ids)
        assert torch.equal(seen[s.sample_id][1], s.hidden_states)


def test_dataloader_workers_on_a_local_run_with_packing(random_run):
    out, samples, _ = random_run
    ds = HiddenStatesDataset(out, layout="eagle3")
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=PackCollator(max_tokens=128))
    tokens = {}
    for batch in loader:
        for k, i in enumerate(batch["sample_index"].tolist()):
            cu = batch["cu_seqlens"]
            tokens[batch["sample_id"][i]] = batch["input_ids"][batch["attention_mask"].bool()][cu[k]:cu[k + 1]]
    assert sorted(tokens) == [s.sample_id for s in samples]
    assert all(torch.equal(tokens[s.sample_id], s.token_ids) for s in samples)


@pytest.mark.parametrize("world,size", [(3, 10), (4, 4), (5, 3), (1, 7)])
def test_distributed_shares_are_disjoint_and_complete(world, size):
    for epoch in (0, 1):
        shares = []
        for rank in range(world):
            sampler = ShardSampler(size, num_replicas=world, rank=rank, shuffle=True, seed=11)
            sampler.set_epoch(epoch)
            share = list(sampler)
            assert len(share) == len(sampler)
            shares.append(share)
        flat = [i for share in shares for i in share]
        assert sorted(flat) == list(range(size))  # complete, and disjoint (no index twice)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    orders = [list(ShardSampler(50, 2, 0, seed=1)), list(ShardSampler(50, 2, 0, seed=2))]
    assert orders[0] != orders[1]


def test_distributed_ranks_through_dataloaders_see_every_sample_once(random_run):
    out, samples, _ = random_run
    ds = HiddenStatesDataset(out)
    seen = []
    for rank in range(3):
        loader = DataLoader(ds, batch_size=2, sampler=ShardSampler(ds, num_replicas=3, rank=rank),
                            collate_fn=PadCollator())
        seen += [sid for batch in loader for sid in batch["sample_id"]]
    assert sorted(seen) == [s.sample_id for s in samples]


def test_shard_sampler_needs_a_world(random_run):
    with pytest.raises(ValueError, match="needs num_replicas and rank"):
        ShardSampler(10)
    with pytest.raises(ValueError, match="outside 0..1"):
        ShardSampler(10, num_replicas=2, rank=2)
