"""One request's hidden states out of vLLM's block cache, onto the host (the plug-in's copy; imports nothing of vLLM).

    HostCopy().rows(cache, block_ids, block_size, num_tokens, order) -> [T, L, H] on the CPU

cache is the extract_hidden_states pseudo-drafter's [blocks, layers, block_size, hidden]; a request's token t sits in
block block_ids[t // block_size], slot t % block_size. `order` puts the captured layers (vLLM captures them sorted) in
the order the run asked for. On CUDA the rows are copied into pinned host memory on a copy stream of their own (DMA,
no pageable staging; the copy waits for the work that wrote the cache, not for anything queued after it); on CPU the
gathered tensor is the host tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HostCopy:
    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def rows(self, cache: torch.Tensor, block_ids: Sequence[int], block_size: int, num_tokens: int,
             order: Sequence[int]) -> torch.Tensor:
        blocks = torch.tensor(list(block_ids), dtype=torch.long)
        slots = (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[:num_tokens]
        slots = slots.to(cache.device)
        rows = cache[slots // block_size, :, slots % block_size]  # [T, L, H], a new tensor
        if list(order) != sorted(order):
            rows = rows[:, list(order)]
        if rows.device.type != "cuda":
            return rows.to("cpu")
        stream = self._streams.get(rows.device)
        if stream is None:
            stream = self._streams[rows.device] = torch.cuda.Stream(rows.device)
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(rows.device))  # the gather above, and what wrote the cache
        with torch.cuda.stream(stream):
            host.copy_(rows, non_blocking=True)
        rows.record_stream(stream)  # the allocator keeps `rows` until the copy has read it
        stream.synchronize()
        return host
