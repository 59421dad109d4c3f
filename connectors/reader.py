"""Reading hidden-states files from any fsspec URL: whole, a token range, a layer subset, or the header alone.

    load_hidden_states(path, ..., verify=False, dtype=None)
                                      -> {"token_ids" [T], "hidden_states" [T, L, H], "loss_mask" [T] if stored,
                                         "target_topk_ids" / "target_topk_logprobs" [T, K] in a top-k target run};
                                         fp8 states (hidden_states_scales beside them) come back dequantized
    read_rows(fs, path, max_rows)     -> (HiddenStatesFileInfo, {name: the leading rows}), checksum checked: the
                                         training feed's read (local files memory-mapped); dequantize=False keeps
                                         fp8 states as stored, beside their scales
    read_hidden_states_info(path)     -> HiddenStatesFileInfo (tensors, shapes, metadata, checksum), header only
    verify_hidden_states(path)        -> HiddenStatesFileInfo, after reading the whole file: header, checksum, and
                                         no NaN/Inf in hidden_states (what `hsx verify` runs per file)
    cleanup_hidden_states(path, keep_hidden_states=False)

A file whose write is still pending is waited for (up to `wait_timeout` seconds), never read partial. A token-range
load reads the header and one byte range per tensor; layers are selected after reading the token rows (a row holds
all L layers contiguously).

Nothing in a file is trusted. The header is checked against the file's real size before any data is read
(`connectors.header.parse_header`); local paths that are not regular files (FIFOs, devices, directories, symlinks to
them) are refused without blocking; a read that comes back short is refused. Every refusal is a
`connectors.format.HiddenStatesFileError` (a ValueError) naming the file, the problem and what to do.

Checksums: `verify=True` hashes the whole data region and compares it with the checksum in the header, so it reads
the whole file even for a token range or a layer subset (streamed in blocks, not held). Files without a checksum
(vLLM's) have nothing to verify and load as they are.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

from connectors import storage
from connectors.format import (
    HIDDEN_STATES,
    HIDDEN_STATES_SCALES,
    LOSS_MASK,
    MM_TOKEN_TYPE_IDS,
    POSITION_IDS,
    TARGET_TOPK_IDS,
    TARGET_TOPK_LOGPROBS,
    TOKEN_IDS,
    HiddenStatesFileError,
    checksum_value,
    data_checksum,
    data_hasher,
)
from connectors.header import (
    HiddenStatesFileInfo,
    TensorEntry,
    check_checksum,
    parse_header,
    read_header,
    tensor_from_bytes,
)
from connectors.quant import dequantize as dequantize_states

DEFAULT_WAIT_TIMEOUT_S = 60.0
ROW_TENSORS = (TOKEN_IDS, HIDDEN_STATES, HIDDEN_STATES_SCALES, TARGET_TOPK_IDS, TARGET_TOPK_LOGPROBS, LOSS_MASK,
               MM_TOKEN_TYPE_IDS, POSITION_IDS)
"""The tensors of a file with one row per token, which a token range reads a slice of."""
# verify streams the data region in blocks of about this many bytes (whole rows of each tensor)
SCAN_BLOCK_BYTES = 16 << 20


def _read_info(path: str, size: int, read) -> HiddenStatesFileInfo:
    return read_header(path, size, lambda start, end: _exact(path, read([start], [end])[0], end - start))[0]


def _exact(path: str, blob: bytes, expected: int) -> bytes:
    """`blob` if it holds exactly the `expected` bytes asked for; a short read means the file shrank under us."""
    if len(blob) != expected:
        raise HiddenStatesFileError(path, f"a read of {expected} bytes returned {len(blob)}: the file is not the size "
                                          "its header says (truncated, or replaced while being read); retry, or "
                                          "re-extract it")
    return blob


def read_hidden_states_info(path: str, *, storage_options: dict | None = None,
                            wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S,
                            byte_range: tuple[int, int] | None = None) -> HiddenStatesFileInfo:
    """The file's tensors, shapes and `__metadata__`, reading only its header (checked against the file's size).
    `byte_range` (offset, length): the sample stored at those bytes of a shard (see load_hidden_states)."""
    fs, p = storage.open_url(path, storage_options)
    storage.wait_until_readable(fs, p, wait_timeout)
    with storage.read_ranges(fs, p, byte_range) as (size, read):
        return _read_info(path, size, read)


def read_rows(fs, path: str, max_rows: int | None = None, *, verify: bool = True,
              names: Sequence[str] = (TOKEN_IDS, HIDDEN_STATES, LOSS_MASK),
              dtype: torch.dtype | None = None, dequantize: bool = True,
              byte_range: tuple[int, int] | None = None) -> tuple[HiddenStatesFileInfo, dict]:
    """Header and the leading `max_rows` rows (all rows when None) of the tensors in `names` the file holds (a tensor
    not per token, an image prompt's mm_embeds, whole). With
    `verify`, the whole data region is hashed and checked against the header's checksum (files without one are read
    as they are); without it only those tensors' bytes are read. `fs`/`path` as `storage.open_url` gives them.
    hidden_states stored scaled (fp8) come back dequantized to `dtype` (default: the model dtype the file records,
    float32 for a file without hsx metadata), reading only the scales of the rows asked for; `dequantize=False`
    returns them as stored, with their hidden_states_scales (rows alike).

    The training feed's read: a local file is memory-mapped copy-on-write (its tensors share the page cache; edits
    stay private), a small remote file arrives whole with its header in one request, a large one as header + one
    byte range per tensor (only the leading rows unless verified). `byte_range` (offset, length): the sample stored at
    those bytes of a shard, read the same way (a local shard is mapped whole, its other samples' pages never touched)."""
    if HIDDEN_STATES in names:
        names = (*names, HIDDEN_STATES_SCALES)
    info, out = _read_rows(fs, path, max_rows, verify, names, byte_range)
    return info, _dequantized(info, out, dtype) if dequantize else out


def _dequantized(info: HiddenStatesFileInfo, out: dict, dtype: torch.dtype | None) -> dict:
    """`out` with hidden_states as values in `dtype`, by default the model dtype the file records (scaled ones
    dequantized and the scales dropped; ones stored in another dtype cast)."""
    scales = out.pop(HIDDEN_STATES_SCALES, None)
    target = dtype or model_dtype(info)
    if HIDDEN_STATES in out and (scales is not None or out[HIDDEN_STATES].dtype != target):
        out[HIDDEN_STATES] = dequantize_states(out[HIDDEN_STATES], scales, target)
    return out


def model_dtype(info: HiddenStatesFileInfo) -> torch.dtype:
    """The dtype a file's hidden_states stand for: the model dtype its hsx metadata records; float32 for a scaled
    file without it (speculators' fp8); the stored dtype otherwise."""
    spec = info.spec
    if spec is not None:
        return spec.torch_dtype
    return torch.float32 if info.scaled else info.dtype


def _read_rows(fs, path: str, max_rows: int | None, verify: bool, names: Sequence[str],
               byte_range: tuple[int, int] | None = None) -> tuple[HiddenStatesFileInfo, dict]:
    if storage.is_local(fs):
        # memory-mapped, copy-on-write: tensors share the page cache (no copy), in-place edits stay private
        with storage.open_regular_file(path) as (fd, size):
            base, size = storage.sample_window(path, size, byte_range)
            if size < 8:
                raise HiddenStatesFileError(path, f"{size} bytes is too short for a safetensors file (need at least "
                                                  "8); the file is truncated: re-extract it")
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        info, _ = read_header(path, size, lambda start, end: mm[base + start:base + min(end, size)])
        if verify and info.checksum is not None:
            with memoryview(mm) as view:
                check_checksum(info, data_checksum([view[base + info.data_start:base + size]]))
        rows = info.num_tokens if max_rows is None else min(max_rows, info.num_tokens)
        out = {}
        for name in names:
            if name in info.tensors:
                e = info.tensors[name]
                shape = (rows if name in ROW_TENSORS else e.shape[0], *e.shape[1:])  # mm_embeds: all its rows
                count = math.prod(shape)
                out[name] = (torch.frombuffer(mm, dtype=e.dtype, count=count, offset=base + e.start).reshape(shape)
                             if count else torch.empty(shape, dtype=e.dtype))
        return info, out

    url = storage.full_url(fs, path)
    if byte_range is None:
        origin, size = 0, (lambda: storage.size_of(fs, path))
    else:
        origin, size = storage.sample_window(url, storage.size_of(fs, path), byte_range)
    end_of = (lambda end: end) if byte_range is None else (lambda end: min(end, size))
    info, probe = read_header(url, size, lambda start, end: fs.cat_file(path, start=origin + start,
                                                                     end=origin + end_of(end)))
    whole = len(probe) == info.size  # a small file arrives whole with its header
    rows = info.num_tokens if max_rows is None else min(max_rows, info.num_tokens)
    names = [n for n in names if n in info.tensors]
    checked = verify and info.checksum is not None
    data, base = None, 0  # bytes in hand, and the file offset of their first byte
    if whole:
        data = memoryview(probe)
    elif checked:  # the whole data region, in one request: all of it is hashed, whatever max_length keeps
        region = fs.cat_file(path, start=origin + info.data_start, end=origin + info.size)
        data, base = memoryview(_exact(url, region, info.size - info.data_start)), info.data_start
    if checked:
        check_checksum(info, data_checksum([data[info.data_start - base:]]))
    counts = [rows if n in ROW_TENSORS else info.tensors[n].shape[0] for n in names]  # mm_embeds: all its rows
    spans = [(info.tensors[n].start, info.tensors[n].start + k * info.tensors[n].row_bytes)
             for n, k in zip(names, counts)]
    if data is not None:
        blobs = [data[a - base:b - base] for a, b in spans]
    else:
        todo = [i for i, (a, b) in enumerate(spans) if b > a]
        fetched = fs.cat_ranges([path] * len(todo), [origin + spans[i][0] for i in todo],
                                [origin + spans[i][1] for i in todo], on_error="raise") if todo else []
        blobs = [b""] * len(spans)
        for i, blob in zip(todo, fetched):
            blobs[i] = blob
    out = {}
    for n, (a, b), blob, k in zip(names, spans, blobs, counts):
        out[n] = tensor_from_bytes(bytearray(_exact(url, blob, b - a)), info.tensors[n], k)
    return info, out


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
                       verify: bool = False, storage_options: dict | None = None,
                       wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S, dtype: torch.dtype | None = None,
                       dequantize: bool = True, byte_range: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Load a hidden-states file (vLLM's or hsx's) from a local path or any fsspec URL.

    token_range:   (start, end) rows to read, Python-slice style; only those bytes are fetched (unless `verify`).
    layer_ids:     hidden-state ids to keep (needs hsx metadata), in the order given.
    layer_indices: positions along the L axis to keep (works for any file).
    verify:        hash the whole data region and compare with the header's checksum; HiddenStatesFileError on a
                   mismatch. Reads the whole file, whatever part is asked for. Files without a checksum pass.
    wait_timeout:  seconds to wait for a pending write before TimeoutError.
    dtype:         what fp8 hidden_states (stored with hidden_states_scales) come back as: default the model dtype
                   the file records (float32 for a file without hsx metadata, e.g. speculators').
    dequantize:    False returns fp8 states as stored, with their hidden_states_scales (layers selected alike).
    byte_range:    (offset, length) of one sample in a shard object (a run of the sharded layout: its manifest row's
                   `offset` and `bytes`): only those bytes are read, as if they were the file.

    A whole load returns every tensor of the file; a token range returns those rows of every per-token tensor
    (token_ids, hidden_states, loss_mask, a top-k target's tensors, an image prompt's mm_token_type_ids and
    position_ids, and only the scales of those rows; not mm_embeds, which is per image token). Either way scaled
    states come back as values, the scales dropped, unless
    `dequantize=False`.
    """
    fs, p = storage.open_url(path, storage_options)
    storage.wait_until_readable(fs, p, wait_timeout)
    if token_range is None and not storage.is_local(fs):
        if byte_range is None:
            data = fs.cat_file(p)  # one request: the header below is this version's
        else:
            origin, length = storage.sample_window(path, storage.size_of(fs, p), byte_range)
            data = _exact(path, fs.cat_file(p, start=origin, end=origin + length), length)
        info, _ = parse_header(path, data, len(data))
        positions = _layer_positions(info, layer_ids, layer_indices)
        view = memoryview(data)
        if verify:
            check_checksum(info, data_checksum([view[info.data_start:]]))
        out = {n: tensor_from_bytes(bytearray(view[e.start:e.end]), e) for n, e in info.tensors.items()}
    else:
        with storage.read_ranges(fs, p, byte_range) as (size, read):
            info = _read_info(path, size, read)
            positions = _layer_positions(info, layer_ids, layer_indices)
            if token_range is None:  # every tensor, whole: the blobs are the data region, hashed as they are
                entries = sorted(info.tensors.values(), key=lambda e: (e.start, e.end))
                blobs = [_exact(path, b, e.end - e.start)
                         for e, b in zip(entries, read([e.start for e in entries], [e.end for e in entries]))]
                if verify:
                    check_checksum(info, data_checksum(blobs))
                out = {e.name: tensor_from_bytes(bytearray(b), e) for e, b in zip(entries, blobs)}
            else:
                if verify:
                    _scan(info, read, finite=False)
                out = _read_token_range(info, read, token_range)
    if positions is not None:
        out[HIDDEN_STATES] = out[HIDDEN_STATES][:, positions].contiguous()
        scales = out.get(HIDDEN_STATES_SCALES)
        if scales is not None and scales.shape[1] != 1:  # per token and layer; [T, 1, 1] broadcasts as it is
            out[HIDDEN_STATES_SCALES] = scales[:, positions].contiguous()
    return _dequantized(info, out, dtype) if dequantize else out


def _read_token_range(info: HiddenStatesFileInfo, read, token_range: tuple[int, int]) -> dict[str, torch.Tensor]:
    start, end, _ = slice(*token_range).indices(info.num_tokens)
    end = max(start, end)
    names = [n for n in ROW_TENSORS if n in info.tensors]
    entries = [info.tensors[n] for n in names]
    starts = [e.start + start * e.row_bytes for e in entries]
    ends = [e.start + end * e.row_bytes for e in entries]
    blobs = read(starts, ends) if end > start else [b""] * len(entries)
    return {n: tensor_from_bytes(bytearray(_exact(info.path, b, z - a)), e, end - start)
            for n, e, a, z, b in zip(names, entries, starts, ends, blobs)}


def verify_hidden_states(path: str, *, storage_options: dict | None = None,
                         wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S,
                         byte_range: tuple[int, int] | None = None) -> HiddenStatesFileInfo:
    """Read the whole file and check it; return its info, or raise HiddenStatesFileError saying what is wrong.

    Checks: the header (as every read does), the data against the header's checksum (files without one, such as
    vLLM's, have none to check: `info.checksum` is None), and that hidden_states (and a top-k target's
    log-probabilities) hold no NaN or Inf (the first one is reported by token and layer position, or rank). Memory stays bounded: the data is streamed in blocks.
    """
    fs, p = storage.open_url(path, storage_options)
    storage.wait_until_readable(fs, p, wait_timeout)
    with storage.read_ranges(fs, p, byte_range) as (size, read):
        info = _read_info(path, size, read)
        _scan(info, read, finite=True)
    return info


def _scan(info: HiddenStatesFileInfo, read, *, finite: bool) -> None:
    """Stream the whole data region in file order: check the checksum, then (if `finite`) that hidden_states is
    finite. A damaged file is reported as damaged before any NaN its damage may have made."""
    hasher = data_hasher()
    first_bad: tuple[str, int, int] | None = None
    for e in sorted(info.tensors.values(), key=lambda e: (e.start, e.end)):
        if e.end == e.start:
            continue
        step = max(1, SCAN_BLOCK_BYTES // e.row_bytes) * e.row_bytes if e.row_bytes else e.end - e.start
        for a in range(e.start, e.end, step):
            b = min(a + step, e.end)
            blob = _exact(info.path, read([a], [b])[0], b - a)
            hasher.update(blob)
            if finite and first_bad is None and e.name in (HIDDEN_STATES, TARGET_TOPK_LOGPROBS) \
                    and e.dtype.is_floating_point:
                first_bad = _first_non_finite(blob, e, (a - e.start) // e.row_bytes)
    check_checksum(info, checksum_value(hasher))
    if first_bad is not None:
        name, t, j = first_bad
        ids = info.layer_ids
        which = (f"layer {j} (hidden-state id {ids[j]}) of hidden_states [T, L, H]" if ids else
                 f"layer {j} of hidden_states [T, L, H]") if name == HIDDEN_STATES else \
            f"rank {j} of {TARGET_TOPK_LOGPROBS} [T, K]"
        raise HiddenStatesFileError(info.path, f"non-finite values (NaN or Inf) at token {t}, {which}; the data is "
                                               "intact (checksum matches) but the model produced them: check the "
                                               "model and dtype (fp16 overflows?), then re-extract")


def _first_non_finite(blob: bytes, entry: TensorEntry, first_row: int) -> tuple[str, int, int] | None:
    """(name, token, position along dim 1) of the first NaN/Inf in rows of `entry` ([t, L, H] hidden_states, [t, K]
    log-probabilities) given as raw bytes."""
    rows = tensor_from_bytes(bytearray(blob), entry, len(blob) // entry.row_bytes)
    finite = torch.isfinite(rows.float() if rows.element_size() == 1 else rows)  # float8 has no isfinite of its own
    if bool(finite.all()):
        return None
    t, j = (~finite).nonzero()[0].tolist()[:2]
    return entry.name, first_row + t, j


def cleanup_hidden_states(path: str, keep_hidden_states: bool = False, *,
                          storage_options: dict | None = None) -> None:
    """Remove a file's lock and, unless `keep_hidden_states`, the file itself. Missing files are fine."""
    fs, p = storage.open_url(path, storage_options)
    storage.remove(fs, p, keep_data=keep_hidden_states)
