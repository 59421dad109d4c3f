"""A long request's per-token streams staged on local disk, so its memory stays bounded until its file is written.

    Spool(directory)                    one anonymous file per stream in `directory`: it has no name (O_TMPFILE, or
                                        a name unlinked at once), so nothing is left behind, even after a crash
    append(name, rows)                  rows [t, ...] of stream `name` (token_ids, hidden_states, its scales, a
                                        top-k target's tensors, ...) after its earlier rows; dtype and row shape
                                        fixed by the first append
    stream(name) -> SpooledTensor       the stream as a tensor the file writer takes (connectors.safetensors_file):
                                        dtype, shape, and blocks() that read it back from the start each time
    nbytes                              bytes appended over all streams
    close()                             releases the files (their disk space with them); idempotent

Streams are independent files because a safetensors file keeps each tensor contiguous: token_ids of every chunk
come before the first row of hidden_states. The connector (connectors.safetensors_connector) appends pieces on its
writer threads, one piece of a request at a time, and assembles the file from the spool when the request finishes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import torch

READ_BLOCK_BYTES = 1 << 20
"""Bytes read back per block when the file is assembled (hashed and written while still in the CPU's cache)."""


@dataclass
class SpooledTensor:
    """One stream of a spool as the file writer sees a tensor: its dtype, its shape, its bytes block by block."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    file: BinaryIO
    nbytes: int

    def blocks(self) -> Iterator[bytes]:
        """The stream's bytes from the start, READ_BLOCK_BYTES at a time (pread: no shared file position, so every
        write attempt reads the same bytes)."""
        fd = self.file.fileno()
        offset = 0
        while offset < self.nbytes:
            block = os.pread(fd, min(READ_BLOCK_BYTES, self.nbytes - offset), offset)
            if not block:
                raise OSError(f"spool file ended at byte {offset} of {self.nbytes}; was its disk full or the file "
                              "truncated?")
            offset += len(block)
            yield block


class Spool:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._streams: dict[str, SpooledTensor] = {}
        self.nbytes = 0

    def append(self, name: str, rows: torch.Tensor) -> None:
        """Append rows [t, ...] to stream `name` (created on first use, in the order streams are first appended)."""
        stream = self._streams.get(name)
        if stream is None:
            os.makedirs(self.directory, exist_ok=True)
            file = tempfile.TemporaryFile(dir=self.directory, prefix=".hsx-spool-")  # no name: O_TMPFILE on Linux
            stream = self._streams[name] = SpooledTensor(rows.dtype, (0, *rows.shape[1:]), file, 0)
        elif rows.dtype != stream.dtype or tuple(rows.shape[1:]) != stream.shape[1:]:
            raise ValueError(f"spool stream {name!r} holds {stream.dtype} rows {list(stream.shape[1:])}, got "
                             f"{rows.dtype} {list(rows.shape[1:])}")
        if rows.numel():
            data = rows.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            stream.file.write(memoryview(data))
            stream.nbytes += data.nbytes
            self.nbytes += data.nbytes
        stream.shape = (stream.shape[0] + rows.shape[0], *stream.shape[1:])

    def stream(self, name: str) -> SpooledTensor:
        stream = self._streams[name]
        stream.file.flush()
        return stream

    def __contains__(self, name: str) -> bool:
        return name in self._streams

    def close(self) -> None:
        for stream in self._streams.values():
            stream.file.close()
        self._streams.clear()
