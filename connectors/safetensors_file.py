"""One safetensors file's bytes, written through the one atomic write (connectors.storage.put_atomic).

    write_atomic(fs, path, tensors, meta, root=)   a hidden-states file: durable, never seen partial, the data's
                                                   checksum in its header (`connectors.format.CHECKSUM_KEY`, hashed
                                                   on the calling thread); transient errors retried with backoff.
                                                   A tensor may be given as its chunks along dim 0 (prefill chunks,
                                                   decode rows): written back to back from their own memory, never
                                                   concatenated in RAM first; or as a stream of a spool on local
                                                   disk (connectors.spool): read back block by block, hashed in the
                                                   same pass and uploaded streaming, never whole in memory
    safetensors_content(tensors, meta)             any safetensors file's bytes for put_atomic, deterministic
                                                   (exports, checkpoints)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import BinaryIO

import fsspec
import torch

from connectors.format import CHECKSUM_KEY, CHECKSUM_PLACEHOLDER, checksum_value, data_checksum, data_hasher
from connectors.header import encode_header
from connectors.spool import SpooledTensor
from connectors.storage import Content, is_local, put_atomic, retrying

Tensors = Mapping[str, "torch.Tensor | Sequence[torch.Tensor] | SpooledTensor"]
"""name -> a tensor, the chunks of one along dim 0 (same dtype and trailing shape), or a spooled one, in file order."""
Part = "memoryview | SpooledTensor"


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, tensors: Tensors, metadata: dict[str, str] | None, *,
                 max_attempts: int = 5, backoff_s: float = 0.2, for_s: float | None = None,
                 root: str | None = None) -> int:
    """Write a safetensors file so that no reader ever sees it partial. Returns the bytes written.

    `metadata[CHECKSUM_KEY]` is set to the checksum of the data (`connectors.format.data_checksum` of the bytes
    after the header), replacing any placeholder in place: give the key with `CHECKSUM_PLACEHOLDER` (as
    `request_metadata` does) and the file is exactly `connectors.header.file_size(...)` bytes. The hashing runs here,
    on the caller's (writer) thread; on local disks it runs as the data is written (see `_hashing_writer`).
    Transient errors are retried (exponential backoff with jitter) up to `max_attempts` (or for `for_s` seconds:
    `storage.retrying`), then re-raised; every
    attempt cleans up its own temp file, so a failed write leaves nothing behind. `root`: as for `put_atomic`.
    """
    entries, parts = _layout(tensors)
    metadata = {**(metadata or {}), CHECKSUM_KEY: CHECKSUM_PLACEHOLDER}
    stream = False
    if is_local(fs):
        content: Content = _hashing_writer(entries, metadata, parts)
    elif all(isinstance(p, memoryview) for p in parts):  # in memory: one put of the views (joined by put_atomic)
        metadata[CHECKSUM_KEY] = data_checksum(parts)  # the header that holds it is encoded after hashing
        content = [encode_header(entries, metadata), *parts]
    else:  # spooled: one pass to hash (the header comes first and holds the checksum), one to upload, streaming
        hasher = data_hasher()
        for block in _blocks(parts):
            hasher.update(block)
        metadata[CHECKSUM_KEY] = checksum_value(hasher)
        header = encode_header(entries, metadata)

        def content(f: BinaryIO) -> None:
            f.write(header)
            for block in _blocks(parts):
                f.write(block)
        stream = True
    return retrying("write", path, max_attempts, backoff_s, for_s)(put_atomic, fs, path, content, root=root, stream=stream)


def safetensors_content(tensors: Tensors, metadata: dict[str, str] | None = None) -> list[bytes | memoryview]:
    """A safetensors file's bytes, for put_atomic: our header (tensors in the given order, metadata in its own
    order, so the same tensors give the same bytes in every process; safetensors' own `save` orders metadata by a
    per-process hash) and each tensor's memory after it."""
    entries, views = _layout(tensors)
    return [encode_header(entries, metadata), *views]


def _layout(tensors: Tensors) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], list[Part]]:
    """name -> (dtype, shape) of every tensor, and the raw bytes of every chunk in file order (views, not copies; a
    spooled tensor as itself)."""
    entries: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    parts: list[Part] = []
    for name, value in tensors.items():
        if isinstance(value, SpooledTensor):
            entries[name] = (value.dtype, value.shape)
            parts.append(value)
            continue
        chunks = [value] if isinstance(value, torch.Tensor) else list(value)
        if not chunks:
            raise ValueError(f"tensor {name!r} has no chunks; pass at least one (possibly empty) tensor")
        first = chunks[0]
        for c in chunks[1:]:
            if c.dtype != first.dtype or c.shape[1:] != first.shape[1:]:
                raise ValueError(f"chunks of {name!r} disagree: {first.dtype} {list(first.shape)} vs {c.dtype} "
                                 f"{list(c.shape)}; chunks must share dtype and all but the first dimension")
        entries[name] = (first.dtype, (sum(c.shape[0] for c in chunks), *first.shape[1:]))
        parts += [memoryview(c.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
                  for c in chunks if c.numel()]
    return entries, parts


_HASH_BLOCK_BYTES = 1 << 20  # hashed, then written while still in the CPU's cache


def _blocks(parts: list[Part]) -> Iterator[bytes | memoryview]:
    """The data bytes in file order, _HASH_BLOCK_BYTES at a time at most (a spool reads its own blocks back)."""
    for part in parts:
        if isinstance(part, SpooledTensor):
            yield from part.blocks()
            continue
        for offset in range(0, len(part), _HASH_BLOCK_BYTES):
            yield part[offset:offset + _HASH_BLOCK_BYTES]


def _hashing_writer(entries, metadata: dict[str, str], parts: list[Part]):
    """Local disks: write the header with a placeholder checksum, then the data block by block, each block hashed
    just before it is written (one pass over memory instead of two), then the header again with the real checksum
    (same length: same layout). No reader sees the placeholder: put_atomic renames the file into place after."""
    def write(f: BinaryIO) -> None:
        header = encode_header(entries, metadata)
        f.write(header)
        hasher = data_hasher()
        for block in _blocks(parts):
            hasher.update(block)
            f.write(block)
        final = encode_header(entries, {**metadata, CHECKSUM_KEY: checksum_value(hasher)})
        assert len(final) == len(header), "checksum values have one length"
        f.seek(0)
        f.write(final)
        f.seek(0, os.SEEK_END)  # put_atomic takes the size from the position
    return write
