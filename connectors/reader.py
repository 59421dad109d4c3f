"""Reading hidden-states files from any fsspec URL: whole, a token range, a layer subset, or the header alone.

    load_hidden_states(path, ...)     -> {"token_ids" [T], "hidden_states" [T, L, H], "loss_mask" [T] if stored}
    read_hidden_states_info(path)     -> HiddenStatesFileInfo (tensors, shapes, metadata), reads only the header
    cleanup_hidden_states(path, keep_hidden_states=False)

A file whose write is still pending is waited for (up to `wait_timeout` seconds), never read partial. A token-range
load reads the header and one byte range per tensor; layers are selected after reading the token rows (a row holds
all L layers contiguously).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence

import safetensors.torch
import torch

from connectors import storage
from connectors.format import (
    HIDDEN_STATES,
    LOSS_MASK,
    TOKEN_IDS,
    HiddenStatesFileInfo,
    parse_header,
    read_header,
    tensor_from_bytes,
)

DEFAULT_WAIT_TIMEOUT_S = 60.0


@contextlib.contextmanager
def _ranges(fs, path: str) -> Iterator[tuple[int, Callable[[list[int], list[int]], list[bytes]]]]:
    """(size, read(starts, ends) -> blobs) over one version of one file.

    On a local disk every read goes through one open handle, so a concurrent replace of the file cannot mix the
    header of one version with the rows of another; elsewhere each range is a ranged GET (concurrent on async stores).
    """
    if storage.is_local(fs):
        with open(path, "rb") as f:
            fd = f.fileno()
            yield os.fstat(fd).st_size, lambda starts, ends: [_pread(fd, s, e) for s, e in zip(starts, ends)]
        return
    yield fs.size(path), lambda starts, ends: fs.cat_ranges([path] * len(starts), starts, ends, on_error="raise")


def _pread(fd: int, start: int, end: int) -> bytes:
    parts = []
    while start < end:
        chunk = os.pread(fd, end - start, start)
        if not chunk:
            break  # truncated: parse_header has already checked sizes, so this is a file changed under us
        parts.append(chunk)
        start += len(chunk)
    return b"".join(parts)


def _read_info(path: str, size: int, read) -> HiddenStatesFileInfo:
    return read_header(path, size, lambda start, end: read([start], [end])[0])[0]


def read_hidden_states_info(path: str, *, storage_options: dict | None = None,
                            wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S) -> HiddenStatesFileInfo:
    """The file's tensors, shapes and `__metadata__`, reading only its header."""
    fs, p = storage.open_url(path, storage_options)
    storage.wait_until_readable(fs, p, wait_timeout)
    with _ranges(fs, p) as (size, read):
        return _read_info(path, size, read)


def _layer_positions(info: HiddenStatesFileInfo, layer_ids: Sequence[int] | None,
                     layer_indices: Sequence[int] | None) -> list[int] | None:
    if layer_ids is not None and layer_indices is not None:
        raise ValueError("pass layer_ids or layer_indices, not both")
    if layer_ids is not None:
        stored = info.layer_ids
        if stored is None:
            raise ValueError(f"{info.path} has no hsx metadata naming its layers (written by vLLM?); select layers "
                             f"by position with layer_indices=[0..{info.num_layers - 1}] instead")
        missing = [i for i in layer_ids if i not in stored]
        if missing:
            raise ValueError(f"layer ids {missing} are not in {info.path}; it stores {list(stored)}")
        return [stored.index(i) for i in layer_ids]
    if layer_indices is not None:
        bad = [i for i in layer_indices if not 0 <= i < info.num_layers]
        if bad:
            raise ValueError(f"layer_indices {bad} out of range: {info.path} stores {info.num_layers} layers")
        return list(layer_indices)
    return None


def load_hidden_states(path: str, *, token_range: tuple[int, int] | None = None,
                       layer_ids: Sequence[int] | None = None, layer_indices: Sequence[int] | None = None,
                       storage_options: dict | None = None,
                       wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S) -> dict[str, torch.Tensor]:
    """Load a hidden-states file (vLLM's or hsx's) from a local path or any fsspec URL.

    token_range:   (start, end) rows to read, Python-slice style; only those bytes are fetched.
    layer_ids:     hidden-state ids to keep (needs hsx metadata), in the order given.
    layer_indices: positions along the L axis to keep (works for any file).
    wait_timeout:  seconds to wait for a pending write before TimeoutError.
    """
    fs, p = storage.open_url(path, storage_options)
    storage.wait_until_readable(fs, p, wait_timeout)
    if token_range is None:
        data = fs.cat_file(p)  # one read: the header below is this version's
        out = safetensors.torch.load(data)
        if TOKEN_IDS not in out or HIDDEN_STATES not in out:
            raise ValueError(f"{path}: expected tensors 'token_ids' and 'hidden_states', found {sorted(out)}")
        if layer_ids is None and layer_indices is None:
            return out
        info, _ = parse_header(path, data, len(data))
        positions = _layer_positions(info, layer_ids, layer_indices)
        out[HIDDEN_STATES] = out[HIDDEN_STATES][:, positions].contiguous()
        return out

    with _ranges(fs, p) as (size, read):
        info = _read_info(path, size, read)
        positions = _layer_positions(info, layer_ids, layer_indices)
        start, end, _ = slice(*token_range).indices(info.num_tokens)
        end = max(start, end)
        names = [n for n in (TOKEN_IDS, HIDDEN_STATES, LOSS_MASK) if n in info.tensors]
        entries = [info.tensors[n] for n in names]
        starts = [e.start + start * e.row_bytes for e in entries]
        ends = [e.start + end * e.row_bytes for e in entries]
        blobs = read(starts, ends) if end > start else [b""] * len(entries)
    out = {n: tensor_from_bytes(b, e, end - start) for n, e, b in zip(names, entries, blobs)}
    if positions is not None:
        out[HIDDEN_STATES] = out[HIDDEN_STATES][:, positions].contiguous()
    return out


def cleanup_hidden_states(path: str, keep_hidden_states: bool = False, *,
                          storage_options: dict | None = None) -> None:
    """Remove a file's lock and, unless `keep_hidden_states`, the file itself. Missing files are fine."""
    fs, p = storage.open_url(path, storage_options)
    storage.remove(fs, p, keep_data=keep_hidden_states)
