"""One safetensors file's bytes, written through the one atomic write (connectors.storage.put_atomic).

    write_atomic(fs, path, tensors, meta, root=)   a hidden-states file: durable, never seen partial, the data's
                                                   checksum in its header (`connectors.format.CHECKSUM_KEY`, hashed
                                                   on the calling thread); transient errors retried with backoff.
                                                   A tensor may be given as its chunks along dim 0 (prefill chunks,
                                                   decode rows): written back to back from their own memory, never
                                                   concatenated in RAM first
    safetensors_content(tensors, meta)             any safetensors file's bytes for put_atomic, deterministic
                                                   (exports, checkpoints)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import BinaryIO

import fsspec
import torch

from connectors.format import (
    CHECKSUM_KEY,
    CHECKSUM_PLACEHOLDER,
    checksum_value,
    data_checksum,
    data_hasher,
    encode_header,
)
from connectors.storage import Content, is_local, put_atomic, retrying

Tensors = Mapping[str, "torch.Tensor | Sequence[torch.Tensor]"]
"""name -> a tensor, or the chunks of one along dim 0 (same dtype and trailing shape), in file order."""


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, tensors: Tensors, metadata: dict[str, str] | None, *,
                 max_attempts: int = 5, backoff_s: float = 0.2, root: str | None = None) -> int:
    """Write a safetensors file so that no reader ever sees it partial. Returns the bytes written.

    `metadata[CHECKSUM_KEY]` is set to the checksum of the data (`connectors.format.data_checksum` of the bytes
    after the header), replacing any placeholder in place: give the key with `CHECKSUM_PLACEHOLDER` (as
    `request_metadata` does) and the file is exactly `connectors.format.file_size(...)` bytes. The hashing runs here,
    on the caller's (writer) thread; on local disks it runs as the data is written (see `_hashing_writer`).
    Transient errors are retried (exponential backoff with jitter) up to `max_attempts`, then re-raised; every
    attempt cleans up its own temp file, so a failed write leaves nothing behind. `root`: as for `put_atomic`.
    """
    entries, views = _layout(tensors)
    metadata = {**(metadata or {}), CHECKSUM_KEY: CHECKSUM_PLACEHOLDER}
    if is_local(fs):
        content: Content = _hashing_writer(entries, metadata, views)
    else:
        metadata[CHECKSUM_KEY] = data_checksum(views)  # the header that holds it is encoded after hashing
        content = [encode_header(entries, metadata), *views]
    return retrying("write", path, max_attempts, backoff_s)(put_atomic, fs, path, content, root=root)


def safetensors_content(tensors: Tensors, metadata: dict[str, str] | None = None) -> list[bytes | memoryview]:
    """A safetensors file's bytes, for put_atomic: our header (tensors in the given order, metadata in its own
    order, so the same tensors give the same bytes in every process; safetensors' own `save` orders metadata by a
    per-process hash) and each tensor's memory after it."""
    entries, views = _layout(tensors)
    return [encode_header(entries, metadata), *views]


def _layout(tensors: Tensors) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], list[memoryview]]:
    """name -> (dtype, shape) of every tensor, and the raw bytes of every chunk in file order (views, not copies)."""
    entries: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    views: list[memoryview] = []
    for name, value in tensors.items():
        chunks = [value] if isinstance(value, torch.Tensor) else list(value)
        if not chunks:
            raise ValueError(f"tensor {name!r} has no chunks; pass at least one (possibly empty) tensor")
        first = chunks[0]
        for c in chunks[1:]:
            if c.dtype != first.dtype or c.shape[1:] != first.shape[1:]:
                raise ValueError(f"chunks of {name!r} disagree: {first.dtype} {list(first.shape)} vs {c.dtype} "
                                 f"{list(c.shape)}; chunks must share dtype and all but the first dimension")
        entries[name] = (first.dtype, (sum(c.shape[0] for c in chunks), *first.shape[1:]))
        views += [memoryview(c.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
                  for c in chunks if c.numel()]
    return entries, views


_HASH_BLOCK_BYTES = 1 << 20  # hashed, then written while still in the CPU's cache


def _hashing_writer(entries, metadata: dict[str, str], views: list[memoryview]):
    """Local disks: write the header with a placeholder checksum, then the data block by block, each block hashed
    just before it is written (one pass over memory instead of two), then the header again with the real checksum
    (same length: same layout). No reader sees the placeholder: put_atomic renames the file into place after."""
    def write(f: BinaryIO) -> None:
        header = encode_header(entries, metadata)
        f.write(header)
        hasher = data_hasher()
        for view in views:
            for offset in range(0, len(view), _HASH_BLOCK_BYTES):
                block = view[offset:offset + _HASH_BLOCK_BYTES]
                hasher.update(block)
                f.write(block)
        final = encode_header(entries, {**metadata, CHECKSUM_KEY: checksum_value(hasher)})
        assert len(final) == len(header), "checksum values have one length"
        f.seek(0)
        f.write(final)
        f.seek(0, os.SEEK_END)  # put_atomic takes the size from the position
    return write
