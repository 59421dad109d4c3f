"""An export's files in DEST (a local folder): every write whole and durable, and reading back what a file holds.

    put(path, content)                    `connectors.storage.put_atomic` on the local filesystem: temp file in the
                                          same folder, fsync, rename, fsync the folder. `content`: bytes, a list of
                                          buffers, or a callable(f) writing into a binary file. A file under its
                                          final name is therefore complete; an interrupted write leaves none.
    torch_file_tokens(path, key) -> int   the length of `key` in a torch.save file, or None when it is unreadable
"""

from __future__ import annotations

import fsspec
import torch

from connectors import storage


def put(path: str, content: storage.Content) -> int:
    """Write `path` whole and durably (see the module docstring); returns the bytes written."""
    return storage.put_atomic(fsspec.filesystem("file"), path, content)


def torch_file_tokens(path: str, key: str) -> int | None:
    """tensor `key`'s last dimension in the torch.save file at `path`; None for any file that is not one."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(obj[key].shape[-1])
    except Exception:  # noqa: BLE001 - any unreadable file is rewritten
        return None
