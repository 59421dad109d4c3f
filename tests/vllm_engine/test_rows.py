"""The plug-in's copy of one request's states out of vLLM's block cache (vllm_engine/rows.py; no vLLM needed): the
gathered rows equal a token-by-token reading of the cache, in the run's layer order; on CUDA they land in pinned host
memory through a copy stream (benchmarks/gpu_check.sh runs this file on a GPU)."""

from __future__ import annotations

import pytest
import torch

from vllm_engine.rows import HostCopy

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="needs a CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
def test_rows_are_the_requests_tokens_slot_by_slot_in_the_asked_layer_order(device):
    blocks, layers, block_size, hidden = 7, 3, 4, 5
    cache = torch.randn(blocks, layers, block_size, hidden, generator=torch.Generator().manual_seed(0)).to(device)
    block_ids, tokens, order = [5, 2, 6], 10, [2, 0, 1]
    copy = HostCopy()
    got = copy.rows(cache, block_ids, block_size, tokens, order)
    want = torch.stack([cache[block_ids[t // block_size], :, t % block_size][order] for t in range(tokens)]).cpu()
    assert got.device.type == "cpu" and torch.equal(got, want)
    assert got.is_pinned() == (device == "cuda")
    assert torch.equal(copy.rows(cache, block_ids, block_size, tokens, [0, 1, 2]),  # sorted: no reordering
                       torch.stack([cache[block_ids[t // block_size], :, t % block_size]
                                    for t in range(tokens)]).cpu())
