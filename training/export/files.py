"""An export's files in DEST (a local folder): every write whole and durable, and reading back what a file holds.

    put(path, content)                    `connectors.storage.put_atomic` on the local filesystem: temp file in the
                                          same folder, fsync, rename, fsync the folder. `content`: bytes, a list of
                                          buffers, or a callable(f) writing into a binary file. A file under its
                                          final name is therefore complete; an interrupted write leaves none.
    remove(path)                          remove a file, durably (its folder fsynced); nothing when it is not there
    torch_file_tokens(path, key) -> int   the length of `key` in a torch.save file, or None when it is unreadable
    Journal(path).start(header, entries)  an export under way: a header line, then one line per file known whole
    read_journal(path) -> (header, entries) | None   what a journal holds (a torn last line is dropped)
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterable
from typing import Any

import fsspec
import torch

from connectors import storage


def put(path: str, content: storage.Content) -> int:
    """Write `path` whole and durably (see the module docstring); returns the bytes written."""
    return storage.put_atomic(fsspec.filesystem("file"), path, content)


def _fsync_folder(folder: str) -> None:
    fd = os.open(folder or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Remove `path` and make the removal durable (fsync its folder); nothing when it is not there."""
    try:
        os.remove(path)
    except FileNotFoundError:
        return
    _fsync_folder(os.path.dirname(path))


def torch_file_tokens(path: str, key: str) -> int | None:
    """tensor `key`'s last dimension in the torch.save file at `path`; None for any file that is not one."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(obj[key].shape[-1])
    except Exception:  # noqa: BLE001 - any unreadable file is rewritten
        return None


class Journal:
    """A log of the files an export under way has written whole, beside them in DEST: one JSON header line (the
    export's settings), then one JSON line per file ([relpath, sample id, source checksum]) appended after the file
    itself is durable. So a line never names a file that is not whole; a line lost to a crash only makes the resume
    write that file again. It is started whole (temp name, fsync, rename) before any file changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f = None

    def start(self, header: dict[str, Any], entries: Iterable[list]) -> None:
        """Replace the journal by `header` and `entries` (the files still whole from before), durably."""
        tmp = f"{self.path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(header) + "\n")
                f.writelines(json.dumps(e) + "\n" for e in entries)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        _fsync_folder(os.path.dirname(self.path))
        self._f = open(self.path, "a", encoding="utf-8")

    def add(self, relpath: str, sample_id: str, checksum: str | None) -> None:
        """One file written whole (call after its put returned)."""
        self._f.write(json.dumps([relpath, sample_id, checksum]) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_journal(path: str) -> tuple[dict[str, Any], dict[str, list]] | None:
    """(header, {relpath: [sample id, checksum]}) of the journal at `path`, later lines winning; None when there is
    none or its header cannot be read. A line that does not parse (the torn end of a crash) is dropped."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    try:
        header = json.loads(lines[0]) if lines else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        return None
    entries: dict[str, list] = {}
    for line in lines[1:]:
        try:
            rel, sid, checksum = json.loads(line)
        except (ValueError, TypeError):
            continue
        if isinstance(rel, str):
            entries[rel] = [sid, checksum]
    return header, entries
