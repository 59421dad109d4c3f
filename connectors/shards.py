"""Shards: many samples' files in one object, for runs on object stores (`hsx run --layout sharded`).

One object per sample costs one PUT per sample and leaves millions of small objects to list, copy and pay for; a
shard holds a unit of work's samples (about `--shard-mb` of them) in one object, written with one (multipart) upload.

A shard is the samples' own safetensors files, byte for byte, one after another, each starting at a multiple of
SHARD_ALIGN (zeros between them). Sample i is bytes [offset_i, offset_i + length_i) of the shard, which its manifest
row records (`path` the shard, `offset`, `bytes` the length). Every sample is still a whole safetensors file with
its own header and checksum: every reader takes `byte_range=(offset, length)` and reads it as it reads a file
(`connectors.reader`), fetching only the bytes it needs by range requests.

Exactly once: a shard is written whole by one atomic put (storage.put_atomic, streamed from the worker's local
copies) before any of its rows is reported, so an "ok" row always points into a whole shard. A shard whose rows
never reached the manifest (its worker or the job died in between) is an orphan no reader counts: shard names are
new for every write (a re-run never overwrites a committed shard), and the job removes orphans when it ends
(`remove_orphan_shards`, under the writer lease): unreferenced shards of its own attempt and of earlier ones (their
folder is the attempt id, which sorts by time), never those of a later job that took the lease over.

    SHARD_DIR, SHARD_SUFFIX, SHARD_ALIGN
    new_shard_path(attempt)                   -> "shards/<attempt>/<uuid>.hsxshard", relative to the output root
    shard_spans(sizes)                        -> [(offset, length)], total size: where each file goes
    write_shard(fs, path, files, ...)         -> [(offset, length)]: the local files as one shard, atomically
    remove_orphan_shards(run, referenced, attempt, stop)
                                              -> shards removed (those no manifest row points into)
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
import uuid
from collections.abc import Iterable, Sequence

from connectors import storage

logger = logging.getLogger(__name__)

SHARD_DIR = "shards"
SHARD_SUFFIX = ".hsxshard"
SHARD_ALIGN = 64
"""Each sample starts at a multiple of this (a cache line; safetensors needs 8 for its tensors' alignment)."""
_COPY_BLOCK = 8 << 20


def new_shard_path(attempt: str) -> str:
    """A fresh shard name for the job attempt `attempt`, relative to the output root: never one a committed row can
    point at."""
    return f"{SHARD_DIR}/{attempt}/{uuid.uuid4().hex}{SHARD_SUFFIX}"


def shard_spans(sizes: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
    """(offset, length) of each of `sizes` in a shard, in order, each offset aligned; and the shard's size."""
    spans, end = [], 0
    for size in sizes:
        offset = -(-end // SHARD_ALIGN) * SHARD_ALIGN
        spans.append((offset, int(size)))
        end = offset + int(size)
    return spans, end


def write_shard(fs, path: str, files: Sequence[str], *, attempts: int = 1, backoff_s: float = 0.0,
                for_s: float | None = None) -> list[tuple[int, int]]:
    """Write the local `files` as one shard at `path` (on `fs`) and return each file's (offset, length) in it.

    Streamed: the files are copied into the upload block by block, never held whole. Atomic (storage.put_atomic):
    the shard appears whole or not at all. Retried like the connector's writes (`attempts`, `backoff_s`, `for_s`);
    a file that changed size meanwhile fails the write (OSError) rather than record a wrong range."""
    sizes = [os.path.getsize(f) for f in files]
    spans, total = shard_spans(sizes)

    def content(out) -> None:
        at = 0
        for name, (offset, length) in zip(files, spans):
            out.write(b"\0" * (offset - at))
            with open(name, "rb") as src:
                copied = 0
                while chunk := src.read(_COPY_BLOCK):
                    out.write(chunk)
                    copied += len(chunk)
            if copied != length:
                raise OSError(f"{name} changed size while it was copied into shard {path} ({length} -> {copied} "
                              "bytes); nothing was committed")
            at = offset + length

    def put() -> int:
        return storage.put_atomic(fs, path, content, stream=True)

    written = storage.retrying("shard write", storage.full_url(fs, path), attempts, backoff_s, for_s)(put)
    if written != total:
        raise OSError(f"shard {storage.full_url(fs, path)}: {written} bytes written, {total} expected")
    return spans


def remove_orphan_shards(run, referenced: Iterable[str], attempt: str, stop: threading.Event | None = None) -> int:
    """Remove the shards under `run`'s SHARD_DIR that no manifest row points into (`referenced`: the paths of every
    row, relative to the root), and temp files of shard writes that died, written by attempt `attempt` or earlier
    ones. Only under the writer lease: stops as soon as `stop` is set (the lease was lost). Returns how many."""
    keep = set(referenced)
    removed = 0
    for folder in run.list(SHARD_DIR):
        if folder > attempt:  # a later job's (it took the lease over): never ours to judge
            continue
        run.fs.invalidate_cache(run.path(f"{SHARD_DIR}/{folder}"))
        try:  # dot-names too: the temp file of a local write that died
            names = [posixpath.basename(p.rstrip("/")) for p in run.fs.ls(run.path(f"{SHARD_DIR}/{folder}"),
                                                                            detail=False)]
        except FileNotFoundError:
            continue
        for name in names:
            rel = f"{SHARD_DIR}/{folder}/{name}"
            if SHARD_SUFFIX not in name or rel in keep:
                continue
            if stop is not None and stop.is_set():
                logger.warning("stopped removing orphan shards of %s: the writer lease was lost", run.url)
                return removed
            try:
                run.fs.rm(run.path(rel))
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as e:  # left: an orphan is read by no one; the next job tries again
                logger.warning("could not remove the orphan shard %s: %s", run.url_of(rel), e)
    return removed

