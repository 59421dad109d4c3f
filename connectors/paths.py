"""Where a request's file goes: safe default names, containment of per-request custom paths, and who owns a file.

    default_path(request_id)   {root}/{safe name}.safetensors — any request id becomes a safe file name
    resolve(custom)            a requested `hidden_states_path`, accepted only inside an allowed root
    locate(custom) / default_destination(request_id)
                               the same as a Destination: the path plus the allowed root it lies in (local disks),
                               which the write walks again without following symlinks (`storage.local_parent`)
    PathOwners                 one request per file: live owners (accepted, not yet durable) and committed ones

A custom path is rejected (PathRejected, a ValueError) when it would leave every allowed root: `..` escapes,
absolute paths elsewhere, another protocol or bucket, a symlink on a local disk that points outside, or names an
object store would read literally (`.`/`..` segments, empty segments, backslashes, control characters, `?`/`#`).
Resolution never writes anything. The check is repeated at write time on local disks, race-free, from the root.

A path another request owns (still being written, or written earlier by this connector) is refused (PathInUse, a
ValueError) unless the request says `overwrite=True`. Files that existed before are owned by nobody.
"""

from __future__ import annotations

import functools
import hashlib
import os
import posixpath
import re
import stat
from dataclasses import dataclass

import fsspec

from connectors.folders import holds_model, holds_run
from connectors.storage import LOCK_SUFFIX, TEMP_NAME_EXTRA, writes_in_place

FILE_SUFFIX = ".safetensors"
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
_MAX_STEM = 120
_HASHED = re.compile(r"-[0-9a-f]{32}$")


class PathRejected(ValueError):
    """A custom hidden_states_path that is not allowed; the request fails and nothing is written."""


class PathInUse(ValueError):
    """A destination another request owns (still writing it, or wrote it earlier); this request fails alone."""


@dataclass(frozen=True)
class Destination:
    """Where one request's file goes."""

    path: str
    """What to write: a plain path on local disks, a URL on object stores."""
    root: str | None
    """The allowed root `path` lies in, lexically (local disks); None on object stores, which have no symlinks."""

    @functools.cached_property
    def key(self) -> str:
        """One name per file, whichever spelling of the root reached it (a local root through a symlink or not);
        computed once, so a request claims and releases the same name."""
        if self.root is None:
            return self.path
        return os.path.join(os.path.realpath(self.root), os.path.relpath(self.path, self.root))


def id_digest(any_id: str) -> str:
    """128-bit hex digest of an id's exact text (lone surrogates included)."""
    return hashlib.sha256(str(any_id).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def safe_file_stem(request_id: str) -> str:
    """A file-name stem for any request id, injective in the id (distinct ids never share a file).

    An id that is already a safe name is kept as is (vLLM's `{request_id}.safetensors`) unless it ends like a
    hashed stem; every other id becomes its sanitised form plus "-" and a 128-bit digest of the exact id. The two
    groups cannot meet (only hashed stems end in "-" + 32 hex), and hashed stems differ unless the digests collide.
    """
    rid = str(request_id)
    stem = _SAFE.sub("_", rid).lstrip(".")[:_MAX_STEM]
    if stem == rid and stem and not _HASHED.search(rid):
        return stem
    return f"{stem[:_MAX_STEM - 33] or 'request'}-{id_digest(rid)}"  # <= 160 characters with the suffix


def _split(url: str) -> tuple[type, str, bool]:
    """(filesystem class, normalised protocol-less path, is_local) without creating a filesystem."""
    protocol, _ = fsspec.core.split_protocol(url)
    cls = fsspec.get_filesystem_class(protocol or "file")
    local = "file" in ((cls.protocol,) if isinstance(cls.protocol, str) else cls.protocol)
    path = os.path.abspath(os.path.expanduser(url if protocol is None else cls._strip_protocol(url))) if local \
        else cls._strip_protocol(url).rstrip("/")
    return cls, path, local


# what a file system takes (Linux's NAME_MAX and PATH_MAX) and an object store's key (S3's and GCS's 1024 bytes),
# less what the writer adds to the file's name while it writes
_NAME_MAX, _PATH_MAX, _KEY_MAX = 255, 4095, 1024


def _check_lengths(custom: str, path: str, local: bool, cls: type) -> None:
    """Refuse a path no storage can hold, before anything is written (it would fail at write time instead)."""
    if local:
        name = posixpath.basename(path).encode()
        long_part = next((p for p in path.split("/")[:-1] if len(p.encode()) > _NAME_MAX), None)
        if long_part is not None or len(name) + TEMP_NAME_EXTRA > _NAME_MAX or len(path.encode()) > _PATH_MAX:
            raise PathRejected(f"hidden_states_path {custom[:80]!r}... is too long for a file system: a file name may "
                               f"have at most {_NAME_MAX - TEMP_NAME_EXTRA} bytes here ({_NAME_MAX} less "
                               f"{TEMP_NAME_EXTRA} for the writer's temporary name), a folder name {_NAME_MAX}, the "
                               f"whole path {_PATH_MAX}; use shorter names")
        return
    key = path.partition("/")[2].encode()  # after the bucket
    # stores that take a whole object at once add only the <key>.lock beside it; others write a temporary name first
    extra, why = (len(LOCK_SUFFIX), "its .lock") if writes_in_place(cls) else (TEMP_NAME_EXTRA, "its temporary name")
    if len(key) + extra > _KEY_MAX:
        raise PathRejected(f"hidden_states_path {custom[:80]!r}... is too long for an object store: a key may have at "
                           f"most {_KEY_MAX - extra} bytes here ({_KEY_MAX} less {extra} for {why}); use shorter "
                           "names")


class PathPolicy:
    """Decides the destination of every request for one connector."""

    def __init__(self, root: str, allowed_roots: list[str] | None = None) -> None:
        self.root = str(root)
        self._root_cls, self._root_path, self._root_local = _split(self.root)
        self._allowed = [_split(str(r)) for r in (allowed_roots or [self.root])]

    def default_path(self, request_id: str) -> str:
        """The file for a request with no custom path (a URL for remote roots, a plain path for local)."""
        return self._join(self._root_path, safe_file_stem(request_id) + FILE_SUFFIX)

    def default_destination(self, request_id: str) -> Destination:
        """`default_path` and its root: shared_storage_path."""
        return Destination(self.default_path(request_id), self._root_path if self._root_local else None)

    def _join(self, base: str, name: str) -> str:
        path = posixpath.join(base, name)
        return path if self._root_local else f"{_first_protocol(self._root_cls)}://{path}"

    def resolve(self, custom: str) -> str:
        """Accept `custom` if it lies inside an allowed root; return the URL to write. Raises PathRejected."""
        return self.locate(custom).path

    def locate(self, custom: str) -> Destination:
        """`resolve`, with the allowed root the path lies in. Raises PathRejected."""
        if not isinstance(custom, str) or not custom:
            raise PathRejected(f"hidden_states_path must be a non-empty string, got {custom!r}")
        if any(ord(c) < 32 or c == "\x7f" for c in custom):
            raise PathRejected(f"hidden_states_path {custom!r} contains control characters")
        if not custom.endswith(FILE_SUFFIX):
            raise PathRejected(f"hidden_states_path {custom!r} must end with {FILE_SUFFIX!r}")
        protocol, _ = fsspec.core.split_protocol(custom)
        if protocol is None and not os.path.isabs(custom) and not custom.startswith("~"):
            # relative: under the shared storage root
            if "\\" in custom or any(seg in ("", ".", "..") for seg in custom.split("/")):
                raise PathRejected(f"relative hidden_states_path {custom!r} has empty, '.' or '..' segments or "
                                   "backslashes; give a plain relative path such as 'sub/dir/name.safetensors'")
            custom = self._join(self._root_path, custom)
        try:
            cls, path, local = _split(custom)
        except (ValueError, ImportError) as e:
            raise PathRejected(f"hidden_states_path {custom!r} has an unknown or unusable protocol: {e}") from e
        _check_lengths(custom, path, local, cls)
        symlink_escape: PathRejected | None = None
        for root_cls, root_path, _root_local in self._allowed:
            if cls is not root_cls:
                continue
            if local:
                try:
                    root = self._inside_local(custom, path, root_path)
                except PathRejected as e:  # another allowed root may still hold where the link leads
                    symlink_escape = e
                    continue
                if root is not None:
                    _check_local_way(custom, path, root)
                    return Destination(path, root)
            elif self._inside_remote(custom, path, root_path, cls):
                return Destination(f"{_first_protocol(cls)}://{path}", None)
        if symlink_escape is not None:
            raise symlink_escape
        roots = ", ".join(self._describe(a) for a in self._allowed)
        raise PathRejected(f"hidden_states_path {custom!r} is outside the allowed roots ({roots}); write under one "
                           "of them, or add its root to kv_connector_extra_config['allowed_roots']")

    @staticmethod
    def _inside_local(raw: str, path: str, root: str) -> str | None:
        """The spelling of `root` that `path` lies in lexically (as given, or through its symlinks), or None."""
        real_root = os.path.realpath(root)
        if os.path.commonpath([path, root]) == root:
            lexical = root
        elif os.path.commonpath([path, real_root]) == real_root:
            lexical = real_root
        else:
            return None
        # symlinks anywhere along the path (including the file itself) must stay inside the root
        real = os.path.realpath(path)
        if os.path.commonpath([real, real_root]) != real_root or real == real_root:
            raise PathRejected(f"hidden_states_path {raw!r} goes through a symlink to {real!r}, outside the root "
                               f"{root!r}; write to a real path inside it")
        return lexical

    @staticmethod
    def _inside_remote(raw: str, path: str, root: str, cls: type) -> bool:
        raw_key = raw.split("://", 1)[-1]
        marker = getattr(cls, "root_marker", "")
        if marker and raw_key.startswith(marker):
            raw_key = raw_key[len(marker):]  # memory:///bucket/key: the leading '/' is the root, not an empty segment
        if "\\" in raw_key or any(c in raw_key for c in "?#"):
            raise PathRejected(f"hidden_states_path {raw!r} contains '\\', '?' or '#', which object stores read "
                               "literally; use plain '/'-separated names")
        segments = raw_key.split("/")
        if any(seg in ("", ".", "..") for seg in segments):
            raise PathRejected(f"hidden_states_path {raw!r} has empty, '.' or '..' segments, which object stores "
                               "keep literally; give the plain key")
        return path.startswith(root + "/")

    @staticmethod
    def _describe(allowed: tuple[type, str, bool]) -> str:
        cls, path, local = allowed
        return path if local else f"{_first_protocol(cls)}://{path}"


def _check_local_way(raw: str, path: str, root: str) -> None:
    """Refuse, before any work, a local path the write would fail on after it: a folder standing at the file's
    name, a regular file (or something else) standing where a folder must be, or a symlink below the root (the write
    walks folders without following links, and a link can be re-pointed between the check and the write), or a folder
    on the way below the root that holds a model or an extraction run (a file there would change the model's fingerprint, or
    replace a run's data)."""
    def guarded(folder: str) -> None:
        what = "a model" if holds_model(folder) else "an extraction run" if holds_run(folder) else None
        if what is not None:
            raise PathRejected(f"hidden_states_path {raw!r} lies in {folder}, which holds {what}; hsx never writes "
                               "into a model's or a run's folder: choose a path outside it")

    here = root  # the root itself may be a run's OUTPUT (hsx run writes its own data there): folders below it are checked
    parts = os.path.relpath(path, root).split(os.sep)
    for i, part in enumerate(parts):
        here = os.path.join(here, part)
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return  # the rest is created by the write
        except OSError as e:
            raise PathRejected(f"hidden_states_path {raw!r}: {here} cannot be checked ({e.strerror or e})") from None
        last = i == len(parts) - 1
        if stat.S_ISLNK(st.st_mode) and not last:
            raise PathRejected(f"hidden_states_path {raw!r} goes through the symlink {here}; hsx writes only "
                               "through real folders (a link can be re-pointed mid-write): use the real path")
        if last:
            if stat.S_ISDIR(st.st_mode):
                raise PathRejected(f"hidden_states_path {raw!r} is an existing folder; give the path of a file "
                                   "(ending in .safetensors) inside it")
        elif not stat.S_ISDIR(st.st_mode):
            raise PathRejected(f"hidden_states_path {raw!r}: {here} is a file, not a folder, so nothing can be "
                               "written below it; choose another path")
        else:
            guarded(here)


def _first_protocol(cls: type) -> str:
    return cls.protocol if isinstance(cls.protocol, str) else cls.protocol[0]


class PathOwners:
    """Which request owns each file (by `Destination.key`), so that no request overwrites another's file unasked.

    Live: accepted and not yet durable (nor failed). Committed: written to a custom path by a request that did not
    say overwrite=True. A request for a file another request owns, live or committed, is refused unless it says
    overwrite=True (then it owns the file from now on; two live writers of one file race, the last rename wins). Only
    those requests are remembered once committed, so a job that passes overwrite (hsx's workers: the manifest
    arbitrates) or uses default names (one per request id, vLLM's contract) keeps memory flat. Files that existed
    before are owned by nobody. `max_remembered` bounds the committed files kept for a process that never forgets
    (a long-lived server): past it the oldest is forgotten, as if it had existed before. Not thread-safe: the
    connector calls it under its own lock.
    """

    def __init__(self, max_remembered: int | None = None) -> None:
        if max_remembered is not None and max_remembered < 0:
            raise ValueError(f"max_remembered must be >= 0 or None (no bound), got {max_remembered}")
        self._max = max_remembered
        self._live: dict[str, str] = {}
        self._committed: dict[str, tuple[str, str]] = {}  # key -> (request id, Destination.path), oldest first
        self._keys: dict[str, str] = {}  # Destination.path -> key of the committed ones

    def claim(self, dest: Destination, request_id: str, overwrite: bool) -> None:
        """Make `request_id` the live owner of `dest`; PathInUse when another request owns it (unless `overwrite`)."""
        if not overwrite:
            other = self._live.get(dest.key)
            if other is not None:
                who = "an earlier request with the same id" if other == request_id else f"request {other!r}"
                raise PathInUse(f"request {request_id!r}: {dest.path} is being written by {who}, not yet durable; "
                                "two requests writing one file would both report success while it holds only one. "
                                "Give each request its own hidden_states_path (or, to replace the other's file on "
                                "purpose, pass kv_transfer_params['overwrite'] = True)")
            other = self._committed.get(dest.key, (None,))[0]
            if other is not None:
                raise PathInUse(f"request {request_id!r}: {dest.path} was written earlier by request {other!r}; "
                                "refusing to overwrite it silently. Pass kv_transfer_params['overwrite'] = True to "
                                "replace it, or choose another hidden_states_path")
        self._live[dest.key] = request_id

    def writer_of(self, dest: Destination) -> str | None:
        """The live owner of `dest` (accepted, not yet durable), if any."""
        return self._live.get(dest.key)

    def release(self, dest: Destination, request_id: str, *, committed: bool) -> None:
        """`request_id` is done with `dest`: durable and to be remembered (`committed`), or not (failed, aborted,
        or a request the connector does not remember)."""
        if self._live.get(dest.key) == request_id:
            del self._live[dest.key]
        if committed:
            self._drop(dest.key)  # written again: the newest, under its latest spelling
            self._committed[dest.key] = (request_id, dest.path)
            self._keys[dest.path] = dest.key
            while self._max is not None and len(self._committed) > self._max:
                self._drop(next(iter(self._committed)))

    def forget(self, path: str) -> None:
        """The committed file at `path` (as Destination.path spelled it) is gone: nobody owns it any more."""
        self._drop(self._keys.get(path, path))

    def _drop(self, key: str) -> None:
        _, path = self._committed.pop(key, (None, None))
        if path is not None and self._keys.get(path) == key:
            del self._keys[path]

    @property
    def num_remembered(self) -> int:
        """Files remembered as committed (what a long job's memory grows with)."""
        return len(self._committed)
