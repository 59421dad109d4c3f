"""Storage primitives on fsspec: resolve a URL, write a file atomically, mark and await pending writes.

Everything above this module (connector, reader, dataset) works on any fsspec URL through these few functions:
    open_url(url, storage_options)        -> (fs, path)
    parse_storage_options(value, flag)    -  fsspec options from a dict or JSON text (flags, job files)
    create_exclusive(fs, path, data)      -  create a small file only if absent (leases): True if this call made it
    put_atomic(fs, path, content, root=, stream=)
                                          -  any whole file (bytes, buffers, or a writer function), atomic and durable:
                                             the one atomic write every file of a run goes through (data files,
                                             manifest parts, run.json, exports); stream=True: a writer function's
                                             bytes are uploaded as written (a long request's spool), never whole
    retrying(what, path, attempts, backoff) - tenacity's retry of transient errors (I/O, network), re-raised after
    pending_write(fs, path, root=)        -  context manager: readers of `path` wait while it is held
    local_parent(path, root)              -  (dir fd, name) of a local file's folder, reached from `root` without
                                             following any symlink (UnsafeWritePathError otherwise)
    wait_until_readable(fs, path, timeout)
    remove(fs, path)                      -  idempotent delete of a file and its lock
    open_regular_file(path)               -  (fd, size) of a local file, refusing FIFOs, devices and directories
                                             (symlinks followed) without ever blocking on them
    read_ranges(fs, path, byte_range=)    -  (size, read(starts, ends)) over one version of one file, local or remote,
                                             or over one sample's byte range of a shard (sample_window checks it)
    size_of(fs, path)                     -  an object's size as its store reports it, checked

Bytes only: the safetensors files written through put_atomic are made in connectors/safetensors_file.py.

Atomicity: local disks get a temp file in the same directory, fsynced, then `os.replace` and an fsync of the
directory (a host crash leaves the old file or the whole new one, never a short one under the final name); object
stores (s3, gcs, azure, memory) make an object visible only once its upload completes, so a single put is atomic
there; any other filesystem gets a temp name and a move.

Containment at write time: a path checked when its request was accepted (`connectors.paths`) is written later, on a
writer thread. Given the allowed root it lies in (`root=`), local writes walk from the root to the file's folder
component by component with O_NOFOLLOW and create the temp file, the lock, the rename and the fsync relative to that
folder's descriptor, so a symlink swapped in meanwhile is refused (UnsafeWritePathError), never followed.

Pending writes: a `<file>.lock` companion, as vLLM uses. On local disks the writer holds an exclusive `flock` on it
(vLLM's readers and ours take a shared one, so either side waits for the other); on object stores the lock object's
existence is the signal until the object itself exists (it appears whole). A writer that died leaves a lock behind:
readers of a file that never appeared wait at most their timeout, then raise.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import logging
import os
import posixpath
import stat
import time
import uuid
from collections.abc import Iterator
from typing import BinaryIO

import fsspec
from tenacity import (
    Retrying,
    retry_if_exception,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from connectors.format import (
    HiddenStatesFileError,
)

logger = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"
TEMP_NAME_EXTRA = len("..tmp-") + 32  # a file is written as .<name>.tmp-<32 hex> beside it first (temp_name)


def temp_name(name: str) -> str:
    """The name `name` is written under before it is renamed into place: hidden, unique, in the same folder."""
    return f".{name}.tmp-{uuid.uuid4().hex}"


_ATOMIC_PUT_PROTOCOLS = {"s3", "s3a", "gcs", "gs", "memory", "az", "abfs", "abfss", "adl"}
_INSTALL_HINTS = {"s3": "pip install 'hsx[s3]' (s3fs)", "gs": "pip install 'hsx[gcs]' (gcsfs)",
                  "gcs": "pip install 'hsx[gcs]' (gcsfs)"}


def open_url(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a local path or fsspec URL into a filesystem and a protocol-less path."""
    try:
        return fsspec.core.url_to_fs(str(url), **(storage_options or {}))
    except ImportError as e:
        protocol = str(url).split("://", 1)[0]
        hint = _INSTALL_HINTS.get(protocol, f"install the fsspec implementation for {protocol!r}")
        raise ImportError(f"cannot open {url!r}: {e}. Fix: {hint}") from e


def fs_path(fs: fsspec.AbstractFileSystem, url: str) -> str:
    """`url` (a local path, or a URL on `fs`'s store) as `fs` names it."""
    return url if is_local(fs) else fs._strip_protocol(url)


def parse_storage_options(value: object, flag: str = "--storage-options",
                          example: str = '{"client_kwargs": {"endpoint_url": "http://..."}}') -> dict:
    """fsspec options (or any settings object) given as a dict or as JSON text (a flag, a job file); ValueError naming
    `flag` (and showing `example`) otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON ({e}); pass an object such as '{example}'") from e
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return dict(value)


def has_buckets(fs: fsspec.AbstractFileSystem) -> bool:
    """Object stores whose first path segment is a bucket that must exist before anything is written."""
    return bool(_protocols(fs) & {"s3", "s3a", "gs", "gcs"})


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in _protocols(fs)


def _protocols(fs: fsspec.AbstractFileSystem | type) -> set[str]:
    p = fs.protocol
    return {p} if isinstance(p, str) else set(p)


def writes_in_place(fs: fsspec.AbstractFileSystem | type) -> bool:
    """Whether a put on this filesystem (or its class) lands whole at once, with no temporary name first."""
    return bool(_protocols(fs) & _ATOMIC_PUT_PROTOCOLS)


def full_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A URL that `open_url` maps back to the same file (plain path for local disks)."""
    return path if is_local(fs) else fs.unstrip_protocol(path)


_MISSING_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"})
"""botocore's and google-auth's errors for credentials that are not there: no retry brings them (by name, so that
neither library is imported here)."""


def _is_transient(e: BaseException) -> bool:
    """Errors worth retrying: I/O and network failures, not bad arguments, missing permissions or credentials."""
    permanent = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
                 ValueError, TypeError, KeyError, MemoryError)
    if isinstance(e, permanent) or any(c.__name__ in _MISSING_CREDENTIALS for c in type(e).__mro__):
        return False
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT):
        return False
    return isinstance(e, Exception)


def retrying(what: str, path: str, max_attempts: int, backoff_s: float, for_s: float | None = None) -> Retrying:
    """Retry transient errors with exponential backoff and jitter (both scaled by `backoff_s`, at most 10 s apart),
    then re-raise: `max_attempts` times, or — given `for_s` — for as long as `for_s` seconds since the first attempt
    (an outage of the store that long is ridden out), however many attempts that takes."""
    stop = stop_after_attempt(max_attempts) if for_s is None else stop_after_delay(for_s)
    of = f"{max_attempts}" if for_s is None else f"retrying for {for_s:g} s"
    return Retrying(stop=stop, wait=wait_exponential(multiplier=backoff_s, max=10) + wait_random(0, backoff_s),
                    retry=retry_if_exception(_is_transient), reraise=True,
                    before_sleep=lambda rs: logger.warning("%s of %s failed (attempt %d/%s): %s; retrying", what,
                                                           path, rs.attempt_number, of, rs.outcome.exception()))


Content = "bytes | Sequence[bytes | memoryview] | Callable[[BinaryIO], object]"
"""What `put_atomic` writes: bytes, buffers written back to back (from their own memory, no join on local disks),
or a function that writes into a binary file object (torch.save, a pyarrow stream, ...)."""


def put_atomic(fs: fsspec.AbstractFileSystem, path: str, content: Content, *, root: str | None = None,
               stream: bool = False) -> int:
    """Write a whole file so that readers see no file (or the old one) or all of the new one, durably. Returns bytes.

    Local disks: a temp file in the same directory is written, flushed and fsynced, renamed over `path`, and the
    directory is fsynced, so after a crash `path` is either absent/old or complete (never empty or short: the data
    is on disk before the name points at it, and the name is on disk before this returns). The temp file is removed
    on any failure. With `root` (the allowed root `path` was accepted in), every folder below it is opened without
    following symlinks and the temp file, rename and fsync all happen relative to the parent's descriptor (see
    `local_parent`): a symlink swapped in after the path was checked raises UnsafeWritePathError, nothing written.
    An existing file (or symlink) under the final name is replaced, never followed. Object stores (s3, gcs, azure,
    memory): a single put, which appears whole. Other filesystems: a temp name and a move. No retries here: callers
    that want them wrap it (see `write_atomic`).

    `stream`: a writer function's bytes go to the store as it writes them, never gathered in memory (local disks
    always stream). On s3, gcs and azure the store's own file object uploads them in parts (a multipart, resumable
    or block upload) and the object appears only when that upload completes; on a failure the upload is discarded
    (aborted) and never completed, so no partial object appears. The function must write sequentially (no seek).
    Other filesystems write the temp name that way; memory:// (visible from its open) gathers them as without it.
    """
    parent = posixpath.dirname(path)
    if is_local(fs):
        size = _write_local(path, content, root)
        assert size is not None  # only an exclusive create can find the name taken
        return size
    if stream and callable(content):
        if _protocols(fs) & _COMMIT_ON_CLOSE_PROTOCOLS:
            return _put_streaming(fs, path, content)
        if not writes_in_place(fs):
            if parent:
                fs.makedirs(parent, exist_ok=True)
            tmp = f"{parent}/{temp_name(posixpath.basename(path))}"
            try:
                size = _put_streaming(fs, tmp, content)
                fs.mv(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    if fs.exists(tmp):
                        fs.rm(tmp)
            return size
    if isinstance(content, (bytes, bytearray)):
        data = bytes(content)
    elif callable(content):
        buf = io.BytesIO()
        content(buf)
        data = buf.getvalue()
    else:
        data = b"".join(content)  # one copy: fsspec puts take bytes
    if writes_in_place(fs):
        fs.pipe_file(path, data)
        return len(data)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{parent}/{temp_name(posixpath.basename(path))}"
    try:
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            if fs.exists(tmp):
                fs.rm(tmp)
    return len(data)


_COMMIT_ON_CLOSE_PROTOCOLS = {"s3", "s3a", "gcs", "gs", "az", "abfs", "abfss"}
"""Stores whose file objects upload in parts and make the object appear only when closed (discard() aborts)."""
STREAM_BLOCK_BYTES = 8 << 20
"""Part size of a streamed upload: the memory it buffers (S3's smallest part is 5 MiB)."""


def _put_streaming(fs: fsspec.AbstractFileSystem, path: str, write) -> int:
    """`write(f)` into the store's own file object for `path`; committed by close() only if it returned. On any
    failure the upload is discarded and the object marked closed, so neither an error path nor the garbage
    collector (fsspec's __del__ closes, which would commit) ever completes a partial upload."""
    f = fs.open(path, "wb", block_size=STREAM_BLOCK_BYTES)
    try:
        write(f)
        size = f.tell()
        f.close()  # the upload completes: the object appears, whole
    except BaseException:
        with contextlib.suppress(Exception):
            f.discard()  # s3: abort the multipart upload; gcs: cancel the resumable one
        with contextlib.suppress(Exception):
            f.closed = True
        raise
    return size


def create_exclusive(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> bool:
    """Create `path` holding `data` only if it does not exist; True when this call created it, False when it existed.

    Local disks: the whole file is written under a temp name and hard-linked to `path` (link fails if `path` exists:
    atomic, and no reader sees it partial), then fsynced. Object stores: fsspec's exclusive mode "xb" (s3fs sends
    If-None-Match: *, which S3 enforces; gcsfs sends ifGenerationMatch=0, which GCS answers with 412, raised as
    FileExistsError); other filesystems get fsspec's own exists check, which two writers can race.
    """
    if is_local(fs):
        return _write_local(path, data, None, exclusive=True) is not None
    parent = posixpath.dirname(path)
    if parent and not writes_in_place(fs):
        fs.makedirs(parent, exist_ok=True)
    try:
        with fs.open(path, "xb") as f:
            f.write(data)
    except FileExistsError:
        return False
    return True


def _write_local(path: str, content: Content, root: str | None, *, exclusive: bool = False) -> int | None:
    """The local half of put_atomic and create_exclusive: a temp file in `path`'s folder (reached through
    `local_parent`), written, flushed and fsynced, then renamed over `path` — or, `exclusive`, hard-linked to it,
    which fails if `path` exists (then None) — and the folder fsynced. The temp file is removed whatever happens.
    Returns the bytes written."""
    with local_parent(path, root) as (dir_fd, name):
        tmp = temp_name(name)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666,
                         dir_fd=dir_fd)
            with os.fdopen(fd, "wb") as f:
                _write_content(f, content)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            if exclusive:
                try:
                    os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
                except FileExistsError:
                    return None
            else:
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
        os.fsync(dir_fd)
    return size


def _write_content(f: BinaryIO, content: Content) -> None:
    if isinstance(content, (bytes, bytearray, memoryview)):
        f.write(content)
    elif callable(content):
        content(f)
    else:
        for chunk in content:  # straight from the tensors' memory: as fast as a raw write
            f.write(chunk)


class UnsafeWritePathError(PermissionError):
    """A folder on the way from a write's allowed root to its file is a symlink or not a folder: refused, nothing
    written. Not transient (never retried): the path changed after it was checked, or was never plain folders."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@contextlib.contextmanager
def local_parent(path: str, root: str | None = None) -> Iterator[tuple[int, str]]:
    """(descriptor of `path`'s folder, file name): everything after is created, renamed and fsynced relative to it.

    With `root`, the folder is reached from `root` one component at a time, each opened with O_NOFOLLOW (missing
    ones created with mkdir relative to their parent, which is then fsynced), so no symlink below the root is ever
    followed, whenever it appeared: one met raises UnsafeWritePathError naming the component. `root` itself is opened
    as given (created if missing); `path` must lie lexically inside it. Without `root` the parent is opened by name,
    as any local write does (run.json, manifest parts, exports: paths the caller chose).
    """
    parent, name = os.path.split(path)
    if root is None:
        parent = parent or "."
        os.makedirs(parent, exist_ok=True)
        fd = os.open(parent, _DIR_FLAGS)
        parts: list[str] = []
    else:
        root = os.path.normpath(root)
        rel = os.path.relpath(parent or ".", root)
        if rel == ".." or rel.startswith("../") or os.path.isabs(rel):
            raise ValueError(f"{path!r} is not inside its root {root!r}; this is a bug in the caller")
        parts = [] if rel == "." else rel.split("/")
        os.makedirs(root, exist_ok=True)
        fd = os.open(root, _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            sub = _open_subfolder(fd, part, path, root, "/".join(parts[:i + 1]))
            os.close(fd)
            fd = sub
        yield fd, name
    finally:
        os.close(fd)


def _open_subfolder(fd: int, part: str, path: str, root: str, where: str) -> int:
    """Open folder `part` inside folder `fd` without following a symlink (mkdir it if missing)."""
    try:
        try:
            sub = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):  # another writer made it first: the open below decides
                os.mkdir(part, 0o777, dir_fd=fd)
                os.fsync(fd)  # the new folder's name is durable before any file in it is
            sub = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        try:
            kind = "a symlink" if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode) \
                else "not a folder"
        except OSError:
            kind = "a symlink or not a folder"
        raise UnsafeWritePathError(
            f"refusing to write {path}: {where!r} under its allowed root {root} is {kind}, and symlinks "
            "below the root are never followed. It was checked when the request was accepted, so it probably changed "
            "after that (something replaced it while the request ran); nothing was written. Make it a plain folder "
            "again (or write elsewhere inside the root) and resubmit the request") from e
    return sub


@contextlib.contextmanager
def pending_write(fs: fsspec.AbstractFileSystem, path: str, *, enabled: bool = True, max_attempts: int = 5,
                  backoff_s: float = 0.2, for_s: float | None = None, root: str | None = None,
                  keep: bool = False) -> Iterator[None]:
    """Hold `<path>.lock` while the body writes `path`; readers wait for it (see module docstring). `keep`: on local
    disks the lock file stays, unlocked, after a write that succeeded (vLLM's `load_hidden_states` opens it and fails
    without it; `remove` takes it away with the file).

    On local disks the lock is opened relative to `path`'s folder as `local_parent(path, root)` reaches it, never
    through a symlink (one under the lock's name is replaced by a lock file, as a rename replaces one under the
    file's name). Creating the lock object on a remote store is retried like a write. Failing to remove it afterwards
    is logged, never raised: it must not hide the body's own error, and a leftover lock next to a complete object
    does not block readers (see `wait_until_readable`).
    """
    if not enabled:
        yield
        return
    lock = path + LOCK_SUFFIX
    if is_local(fs):
        with local_parent(path, root) as (dir_fd, name):
            fd = _open_lock(dir_fd, name + LOCK_SUFFIX, lock)
            written = False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
                written = True
            finally:
                if not (keep and written):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name + LOCK_SUFFIX, dir_fd=dir_fd)
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        return
    body = f'{{"pid": {os.getpid()}, "since": {time.time():.3f}}}'.encode()
    retrying("lock", lock, max_attempts, backoff_s, for_s)(fs.pipe_file, lock, body)
    try:
        yield
    finally:
        try:
            fs.rm_file(lock)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - reported, not raised: see docstring
            logger.warning("could not remove %s after writing %s: %s", full_url(fs, lock), full_url(fs, path), e)


def _open_lock(dir_fd: int, name: str, lock: str) -> int:
    """Open (creating) the lock file `name` inside folder `dir_fd`; a symlink there is removed, never followed."""
    flags = os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, 0o644, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
    os.unlink(name, dir_fd=dir_fd)  # removes the link itself
    try:
        return os.open(name, flags | os.O_EXCL, 0o644, dir_fd=dir_fd)
    except FileExistsError as e:
        raise UnsafeWritePathError(f"refusing to write next to {lock}: a symlink keeps appearing under the lock's "
                                   "name (replaced once, back again); something is planting it. Nothing was written; "
                                   "find what writes into the folder") from e


def _write_pending(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """True while a writer holds `path`'s lock."""
    lock = path + LOCK_SUFFIX
    if is_local(fs):
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO planted as the lock must not hang readers
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing releases the shared lock, if it was taken
        return False  # an unheld lock file (vLLM leaves them behind after writing)
    if writes_in_place(fs):
        # an object appears whole or not at all, so once it exists it is readable, whatever lock object is still
        # around (a writer that could not delete it, or one copied along with vLLM output); until then a lock
        # means "coming"
        fs.invalidate_cache(path)
        if fs.exists(path):
            return False
    fs.invalidate_cache(lock)
    return fs.exists(lock)


def wait_until_readable(fs: fsspec.AbstractFileSystem, path: str, timeout: float) -> None:
    """Return once `path` exists with no write pending; FileNotFoundError if it does not exist and none is pending.

    Raises TimeoutError when a write is still pending after `timeout` seconds.
    """
    def timed_out(_state) -> None:
        raise TimeoutError(f"{full_url(fs, path)} is still being written after {timeout:.1f}s (its {LOCK_SUFFIX} is "
                           "held). Wait longer (wait_timeout=...), or, if its writer died, remove it with "
                           "cleanup_hidden_states()")

    Retrying(stop=stop_after_delay(timeout), wait=wait_exponential(multiplier=0.01, max=0.5),
             retry=retry_if_result(bool), retry_error_callback=timed_out)(_write_pending, fs, path)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        raise FileNotFoundError(f"no hidden-states file at {full_url(fs, path)}")


def remove(fs: fsspec.AbstractFileSystem, path: str, *, keep_data: bool = False) -> None:
    """Delete `path` (unless keep_data) and its lock; missing files are fine."""
    targets = [path + LOCK_SUFFIX] + ([] if keep_data else [path])
    for target in targets:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(target)
    fs.invalidate_cache(path)


# -- reading: the file as it is, never more than it holds --------------------------------------------------------

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


@contextlib.contextmanager
def open_regular_file(path: str) -> Iterator[tuple[int, int]]:
    """(fd, size) of the local file `path`, opened read-only; HiddenStatesFileError unless it is a regular file.

    Symlinks are followed: one to /dev/zero is a character device and refused. The open never blocks (O_NONBLOCK: a
    FIFO opens at once, with no writer) and the check is made on the open descriptor, so a file swapped for a FIFO
    between a check and the open cannot slip through.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
            raise HiddenStatesFileError(path, f"is {kind}, not a regular file; a hidden-states file is a regular "
                                              "file — check the path (or what the symlink points at)")
        yield fd, st.st_size
    finally:
        os.close(fd)


ReadRanges = "Callable[[list[int], list[int]], list[bytes]]"
"""read(starts, ends) -> the bytes of each [start, end) range; shorter only when the file is shorter."""


@contextlib.contextmanager
def read_ranges(fs: fsspec.AbstractFileSystem, path: str,
                byte_range: tuple[int, int] | None = None) -> Iterator[tuple[int, ReadRanges]]:
    """(size, read(starts, ends) -> blobs) over one version of one file, or of the `byte_range` (offset, length) of
    it that holds one sample (a shard of the sharded layout): offsets are then relative to the range, and a read never
    returns bytes past its end.

    On a local disk the file is opened once with `open_regular_file` and every read goes through that descriptor, so
    a concurrent replace of the file cannot mix the header of one version with the rows of another; elsewhere the
    size comes from the store (`fs.size`) and each range is a ranged GET (concurrent on async stores).
    """
    if is_local(fs):
        with open_regular_file(path) as (fd, size):
            base, size = sample_window(path, size, byte_range)
            yield size, lambda starts, ends: [_pread(fd, base + s, base + min(e, size)) for s, e in zip(starts, ends)]
        return
    base, size = sample_window(full_url(fs, path), size_of(fs, path), byte_range)
    yield size, lambda starts, ends: fs.cat_ranges([path] * len(starts), [base + s for s in starts],
                                                   [base + min(e, size) for e in ends], on_error="raise")


def sample_window(where: str, object_size: int, byte_range: tuple[int, int] | None) -> tuple[int, int]:
    """(offset, size) of one sample's bytes in an object of `object_size` bytes: the whole object, or `byte_range`
    (offset, length), which must lie inside it (HiddenStatesFileError otherwise)."""
    if byte_range is None:
        return 0, object_size
    offset, length = (int(x) for x in byte_range)
    if offset < 0 or length < 0 or offset + length > object_size:
        raise HiddenStatesFileError(where, f"bytes [{offset}, {offset + length}) are not inside the object, which "
                                           f"holds {object_size} bytes: the shard is truncated or was replaced, or "
                                           "the manifest row's range is wrong; run `hsx verify` on the run and "
                                           "re-run the same `hsx run` to extract what it marks")
    return offset, length


def size_of(fs: fsspec.AbstractFileSystem, path: str) -> int:
    """The size of a stored object as its store reports it; HiddenStatesFileError when the store cannot say."""
    size = fs.size(path)
    if not isinstance(size, int) or size < 0:
        raise HiddenStatesFileError(full_url(fs, path), f"the store reports size {size!r}; hsx needs the size of an "
                                                        "object to read it safely (is this a file?)")
    return size


def _pread(fd: int, start: int, end: int) -> bytes:
    parts = []
    while start < end:
        chunk = os.pread(fd, end - start, start)
        if not chunk:
            break  # the file is shorter than the range: the caller sees a short blob and says so
        parts.append(chunk)
        start += len(chunk)
    return b"".join(parts)
