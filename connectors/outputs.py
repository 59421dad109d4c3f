"""Output folders and files that cannot destroy inputs: what `hsx train-drafter --out / --checkpoint-dir / --log-dir`,
`hsx export DEST`, `hsx verify --report` and `hsx eval-drafter --json / --out` write to is checked before any work, and
a folder has one writer.

    OutputFolder(path, command=..., flag=..., inputs={flag: path})
        .check()            ValueError naming the problem and the fix; creates nothing (also run by open())
        .open()             context manager: creates the folder (and missing parents), probes that it is
                            writable, writes the ownership marker, takes the folder's writer lease (one writer,
                            connectors.lease); on an exception, a folder it created that holds only its own marker
                            and lease is removed again, so a refused or failed command leaves nothing behind
        .lease_lost         an Event set if another writer took the lease over meanwhile (check before writing)
        .check_lease()      LeaseLost when it was
    RemoteOutputFolder(url, ...)     the same surface for a folder on an object store (s3://, gs://): checked against
                                     the URL inputs (not one, not inside or around one) and leased; nothing probed
    output_folder_at(path, ...)      one of the two, by the path (a flag that takes a folder or a URL)
    OutputFolders(main, *more)       the folders of one command (train-drafter's --out, --checkpoint-dir, --log-dir):
                                     .check() / .open() / .check_lease() over all of them. A folder that is, or lies
                                     inside, another of the group is part of that one (its checks and lease cover it;
                                     it must not be a file); every other one is checked and leased on its own
    check_output_file(path, flag=..., inputs={flag: path}, ours=(prefix, ...))
                                     the same rules for one file (a report); an existing one only if hsx wrote it
    check_run_output(path, inputs=)  `hsx run --output`: the rules above for a run's OUTPUT (a run is resumed)
    check_output_place(path, flag=, inputs=)   the relations alone (`hsx serve --output`, `--allowed-roots`)
    corpus_inputs(given, files) / within_output(path, folder) / inside(path, folder)   helpers of the callers
    holds_model / holds_run (connectors/folders.py)          what the rules look for

The rules, for local paths (symlinks resolved, so `./m`, `m/` and the absolute path are one folder):
- the output is not one of the inputs, does not lie inside one, and does not contain one;
- it does not lie inside a folder holding a model (config.json beside weight files) or a run (run.json or
  manifest/), nor is it one — unless it is this command's own earlier output (its marker, OUT/.hsx-output.json,
  names the command), which a re-run resumes;
- an existing folder that is not this command's output must be empty, and a file path must not be a folder;
- it can be written: a temporary file is created and removed in it (or its nearest existing parent) up front.
Inputs that are URLs (s3://...) cannot overlap a local output and are skipped.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence

import fsspec

from connectors import storage
from connectors.folders import MANIFEST_DIR, RUN_JSON, holds_model, holds_run
from connectors.lease import LEASE_FILE, LeaseLost, WriterLease
from connectors.run import RunDir

logger = logging.getLogger(__name__)

MARKER = ".hsx-output.json"
"""An output folder's ownership marker: {"command", "created", "host"}, written when the folder is first taken."""


def _local(path: str | None) -> str | None:
    """The resolved local path of `path`, or None for a URL (or nothing given)."""
    if not path:
        return None
    protocol = str(path).split("://", 1)[0] if "://" in str(path) else "file"
    if protocol not in ("file", "local"):
        return None
    return os.path.realpath(os.path.expanduser(str(path).removeprefix("file://")))


def _what(folder: str) -> str | None:
    if holds_run(folder):
        return "an extraction run"
    if holds_model(folder):
        return "a model"
    return None


def inside(path: str, folder: str) -> bool:
    """Whether resolved `path` is `folder` or lies in it."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _ancestors(path: str) -> Iterator[str]:
    """`path`'s parent folders, nearest first, up to the filesystem root."""
    here = os.path.dirname(path)
    while True:
        yield here
        up = os.path.dirname(here)
        if up == here:
            return
        here = up


def _check_relations(path: str, flag: str, inputs: Mapping[str, str | None], *, is_file: bool,
                     around_ok: bool = False) -> None:
    """`around_ok`: the output may contain an input (a service's folder that only ever adds new files)."""
    fix = f"pick another {flag}: a new folder of its own" if not is_file else f"pick another {flag} path"
    for name, given in inputs.items():
        other = _local(given)
        if other is None or not os.path.exists(other):
            continue  # a URL, or nothing there to overwrite (the command's own checks say what is missing)
        kind = "folder" if os.path.isdir(other) else "file"
        if path == other:
            raise ValueError(f"{flag} {path} is the {name} {kind}; writing there would overwrite it — {fix}")
        if inside(path, other):
            raise ValueError(f"{flag} {path} lies inside the {name} {kind} {other}; writing there could overwrite "
                             f"it — {fix}")
        if inside(other, path) and not around_ok:
            raise ValueError(f"{flag} {path} contains the {name} {kind} {other}; writing there could overwrite "
                             f"it — {fix}")
    for folder in _ancestors(path):
        what = _what(folder)
        if what is not None:
            raise ValueError(f"{flag} {path} lies inside {folder}, which holds {what}; writing there could "
                             f"overwrite it — {fix} outside it")


def _probe(folder: str, flag: str) -> None:
    """Create and remove a temporary file in `folder` (which exists): ValueError when that fails."""
    try:
        fd, name = tempfile.mkstemp(prefix=".hsx-probe-", dir=folder)
    except OSError as e:
        raise ValueError(f"{flag} {folder} cannot be written ({e.strerror or e}); fix its permissions or pick "
                         "another folder") from e
    os.close(fd)
    os.unlink(name)


def _nearest_existing(path: str, flag: str) -> str:
    """The nearest existing folder at or above `path`; ValueError when a file stands on the way."""
    here = path
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise ValueError(f"{flag} {path}: {here} is a file, not a folder; pick a path whose folders are folders")
    return here


def check_output_file(path: str, *, flag: str, inputs: Mapping[str, str | None] | None = None,
                      ours: Sequence[bytes] = (), command: str = "") -> str:
    """The resolved path of an output file (a report) once it passes the module's rules; ValueError otherwise.
    An existing file is replaced only when it is a regular file that is empty or begins with one of `ours` (what the
    command writes first: an earlier output of its own); a device, pipe or socket never (writing goes through a
    rename, which would replace it). Creates nothing: the caller writes the file (atomically) when its work is done."""
    resolved = _local(path)
    if resolved is None:
        raise ValueError(f"{flag} {path}: a local file path is expected")
    if os.path.isdir(resolved):
        raise ValueError(f"{flag} {path} is a folder; give the path of a file to write")
    _check_relations(resolved, flag, dict(inputs or {}), is_file=True)
    if os.path.lexists(resolved):
        if not os.path.isfile(resolved):
            raise ValueError(f"{flag} {path} is not a regular file (a device, pipe or socket); writing there would "
                             f"replace it — pick another {flag} path")
        try:
            with open(resolved, "rb") as f:
                head = f.read(max((len(o) for o in ours), default=0))
        except OSError as e:
            raise ValueError(f"{flag} {path} exists and cannot be read ({e.strerror or e}); pick another {flag} "
                             "path") from e
        if head and not any(head.startswith(o) for o in ours):  # an empty file (mktemp's) is taken
            who = f"hsx {command}" if command else "hsx"
            raise ValueError(f"{flag} {path} exists and is not a file {who} wrote; it replaces only its own — pick a "
                             f"new {flag} path, or move that file away first")
    _probe(_nearest_existing(os.path.dirname(resolved), flag), flag)
    return resolved


def write_output_file(path: str, data: bytes) -> None:
    """Write a checked output file whole (temp name, fsync, rename), creating its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    storage.put_atomic(fsspec.filesystem("file"), path, data)


class OutputFolder:
    """A local folder one command writes (see the module docstring)."""

    def __init__(self, path: str, *, command: str, flag: str = "--out", inputs: Mapping[str, str | None] | None = None,
                 legacy_markers: tuple[str, ...] = (), break_lease: bool = False) -> None:
        if not str(path or "").strip():
            raise ValueError(f"{flag} is required")
        resolved = _local(path)
        if resolved is None:
            raise ValueError(f"{flag} {path}: a local folder is expected (write it there, then copy it to the store)")
        self.given = str(path)
        self.path = resolved
        self.command = command
        self.flag = flag
        self.inputs = dict(inputs or {})
        self.legacy_markers = legacy_markers
        """Files (names or glob patterns, relative to the folder) whose presence marks a folder as this command's
        output from before markers existed."""
        self.break_lease = break_lease
        self.lease_lost = threading.Event()

    # -- checks -----------------------------------------------------------------------------------------------
    def owned(self) -> bool:
        """Whether the folder is this command's own earlier output (its marker, or a legacy marker file)."""
        try:
            with open(os.path.join(self.path, MARKER)) as f:
                return json.load(f).get("command") == self.command
        except (OSError, ValueError, AttributeError):
            pass
        return any(glob.glob(os.path.join(glob.escape(self.path), name)) for name in self.legacy_markers)

    def check(self) -> None:
        """ValueError naming the problem and the fix when this folder must not be written; creates nothing."""
        flag, path = self.flag, self.path
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {self.given} is a file, not a folder; pick a folder (new or empty)")
        _check_relations(path, flag, self.inputs, is_file=False)
        if os.path.isdir(path):
            owned = self.owned()
            what = _what(path)
            if what is not None and not owned:
                raise ValueError(f"{flag} {self.given} holds {what}; writing there would overwrite it — pick a "
                                 "new folder")
            try:
                names = sorted(os.listdir(path))
            except OSError as e:
                raise ValueError(f"{flag} {self.given} cannot be read ({e.strerror or e}); fix its permissions or "
                                 "pick another folder") from e
            if not owned and names:
                shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
                raise ValueError(f"{flag} {self.given} already holds {len(names)} {'entry' if len(names) == 1 else 'entries'} ({shown}) and is not an "
                                 f"output of hsx {self.command}; pick a new or empty folder")
            for name in names:  # a model or run moved into an earlier output of ours
                inner = os.path.join(path, name)
                if os.path.isdir(inner) and (what := _what(inner)) is not None:
                    raise ValueError(f"{flag} {self.given} contains {inner}, which holds {what}; move it out or "
                                     "pick a new folder")
            _probe(path, flag)
        else:
            _probe(_nearest_existing(path, flag), flag)

    # -- taking it --------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def open(self) -> Iterator[OutputFolder]:
        """Check, create, mark, lease; yields self. See the module docstring for what is undone on failure."""
        self.check()
        created = []  # folders this call made, outermost first
        here = self.path
        while not os.path.exists(here):
            created.insert(0, here)
            here = os.path.dirname(here)
        lease = None
        try:
            os.makedirs(self.path, exist_ok=True)
            lease = WriterLease.acquire(RunDir(self.path), f"{self.command}-{uuid.uuid4().hex[:12]}",
                                        break_lease=self.break_lease, command=f"hsx {self.command}",
                                        harm=f"Two writers of one {self.flag} would lose one result")
            if not self.owned():
                write_output_file(os.path.join(self.path, MARKER), json.dumps(
                    {"command": self.command, "created": time.time(), "host": socket.gethostname()}).encode())
            with lease.keep_alive() as lost:
                self.lease_lost = lost
                yield self
        except BaseException:
            if lease is not None:
                lease.release()
                lease = None
            self._undo(created)
            raise
        finally:
            if lease is not None:
                lease.release()

    def check_lease(self) -> None:
        """LeaseLost when another writer took this folder's lease over (stop before writing more)."""
        if self.lease_lost.is_set():
            raise LeaseLost(f"the writer lease on {self.flag} {self.given} was taken over by another hsx "
                               f"{self.command}; this one stops so that neither result is lost half-written")

    def _undo(self, created: list[str]) -> None:
        """Remove the folders this open() created when they hold nothing but the marker (and a lease)."""
        if not created:
            return
        leftovers = set()
        for root, dirs, files in os.walk(self.path):
            leftovers.update(os.path.relpath(os.path.join(root, n), self.path) for n in files)
            leftovers.update(os.path.relpath(os.path.join(root, n), self.path) + "/" for n in dirs)
        if leftovers - {MARKER, LEASE_FILE}:
            return  # the command wrote something (a checkpoint): keep it for a resume
        shutil.rmtree(created[0], ignore_errors=True)


RUN_ENTRIES = (RUN_JSON, MANIFEST_DIR, "data", "shards", "verify", "regenerated", LEASE_FILE, "lost+found")
"""What an extraction run's OUTPUT may hold (hsx's own names, and a fresh disk's lost+found; names starting with "."
are ignored too)."""


def check_output_place(path: str, *, flag: str, inputs: Mapping[str, str | None] | None = None,
                       around_ok: bool = True) -> str | None:
    """The relations every output folder obeys, for a folder a service keeps adding files to (`hsx serve --output`
    and its `--allowed-roots`): never an input or inside one, inside a run or a model, a model folder itself, or a
    file (a folder around the model is fine: new files only). Returns the resolved path (None for a URL); ValueError
    naming the problem and the fix."""
    resolved = _local(path)
    if resolved is None:
        return None
    if os.path.lexists(resolved) and not os.path.isdir(resolved):
        raise ValueError(f"{flag} {path} is a file, not a folder; pick a folder")
    _check_relations(resolved, flag, dict(inputs or {}), is_file=False, around_ok=around_ok)
    if os.path.isdir(resolved) and holds_model(resolved):
        raise ValueError(f"{flag} {path} holds a model; files written there would mix with its weights (and change "
                         "its fingerprint) — pick a new folder")
    return resolved


def corpus_inputs(given: Sequence[str], files: Sequence[str] = ()) -> dict[str, str]:
    """The corpus as output-guard inputs: each --corpus argument as given (a folder, a file; a glob matches no path and
    is skipped) and each file it expanded to, named "--corpus", "--corpus #2", ... (distinct names, one per path)."""
    paths = list(dict.fromkeys([*given, *files]))
    return {"--corpus" + (f" #{i + 1}" if i else ""): p for i, p in enumerate(paths)}


def within_output(path: str, folder: str | None) -> bool:
    """Whether local `path` lies inside local `folder` (both resolved: `~`, symlinks, relative spellings)."""
    here, there = _local(path), _local(folder)
    return here is not None and there is not None and here != there and inside(here, there)


def check_run_output(path: str, *, inputs: Mapping[str, str | None] | None = None) -> None:
    """`hsx run --output` on a local path, checked before the job takes its lease: check_output_place's rules with no
    input inside it either, and a folder that is not a run must hold nothing else; an existing run is resumed. URLs:
    nothing to check here (the lease and run.json guard them). ValueError naming the problem and the fix; creates
    nothing."""
    flag = "--output"
    resolved = check_output_place(path, flag=flag, inputs=inputs, around_ok=False)
    if resolved is None or not os.path.isdir(resolved) or holds_run(resolved):
        return  # a run is resumed (run.json and the manifest say whether it may be), whatever else lies beside it
    try:
        names = sorted(n for n in os.listdir(resolved) if not n.startswith(".") and n not in RUN_ENTRIES)
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be read ({e.strerror or e}); fix its permissions or pick another "
                         "folder") from e
    if names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ValueError(f"{flag} {path} already holds {len(names)} {'entry' if len(names) == 1 else 'entries'} "
                         f"({shown}) that are not an hsx run's; pick a new or empty folder (or the OUTPUT of a run "
                         "to resume it)")


def _url_inside(url: str, folder: str) -> bool:
    return url == folder or url.startswith(folder + "/")


class RemoteOutputFolder:
    """A folder on an object store (s3://, gs://) that one command writes (train-drafter's --checkpoint-dir): never
    one of the URL inputs, inside one or around one; one writer (its `writer.lease`, as for a local folder). Nothing
    is probed or marked: an object store has no folders to create or permissions to test up front."""

    def __init__(self, url: str, *, command: str, flag: str, inputs: Mapping[str, str | None] | None = None,
                 storage_options: Mapping | None = None, break_lease: bool = False) -> None:
        self.run = RunDir(str(url), dict(storage_options or {}))
        self.given, self.path = str(url), self.run.url.rstrip("/")
        self.command, self.flag, self.break_lease = command, flag, break_lease
        self.inputs = dict(inputs or {})
        self.lease_lost = threading.Event()

    def check(self) -> None:
        """ValueError when the folder is, lies inside or contains one of the URL inputs."""
        fix = f"pick another {self.flag}: a folder of its own"
        for name, given in self.inputs.items():
            if not given or _local(given) is not None:
                continue  # a local input cannot overlap a URL
            other = RunDir(str(given), self.run.storage_options).url.rstrip("/")
            if self.path == other:
                raise ValueError(f"{self.flag} {self.given} is the {name} folder; writing there would overwrite it "
                                 f"— {fix}")
            if _url_inside(self.path, other) or _url_inside(other, self.path):
                where = "lies inside" if _url_inside(self.path, other) else "contains"
                raise ValueError(f"{self.flag} {self.given} {where} the {name} folder {other}; writing there could "
                                 f"overwrite it — {fix}")

    @contextlib.contextmanager
    def open(self) -> Iterator[RemoteOutputFolder]:
        """Check and lease; yields self."""
        self.check()
        lease = WriterLease.acquire(self.run, f"{self.command}-{uuid.uuid4().hex[:12]}", break_lease=self.break_lease,
                                    command=f"hsx {self.command}",
                                    harm=f"Two writers of one {self.flag} would lose one result")
        try:
            with lease.keep_alive() as lost:
                self.lease_lost = lost
                yield self
        finally:
            lease.release()

    def check_lease(self) -> None:
        if self.lease_lost.is_set():
            raise LeaseLost(f"the writer lease on {self.flag} {self.given} was taken over by another hsx "
                            f"{self.command}; this one stops so that neither result is lost half-written")


class OutputFolders:
    """The folders one command writes, checked before its work and leased for all of it (see the module docstring).
    The first is the command's main output (--out); the others are its further output flags, each an OutputFolder
    or RemoteOutputFolder of its own (train-drafter: --checkpoint-dir, --log-dir, their defaults inside --out)."""

    def __init__(self, main: OutputFolder, *more: OutputFolder | RemoteOutputFolder) -> None:
        self.main = main
        self.folders: list[OutputFolder | RemoteOutputFolder] = [main]
        """The folders checked and leased on their own, main first."""
        self.parts: list[tuple[OutputFolder, OutputFolder]] = []
        """(folder, the folder of the group it lies in): covered by that one's checks and lease."""
        for folder in sorted(more, key=lambda f: len(f.path)):  # outer folders first
            if isinstance(folder, RemoteOutputFolder):
                if all(folder.path != f.path for f in self.folders):
                    self.folders.append(folder)
                continue
            outer = next((f for f in self.folders if isinstance(f, OutputFolder) and inside(folder.path, f.path)),
                         None)
            if outer is None:
                self.folders.append(folder)
            else:
                self.parts.append((folder, outer))

    def check(self) -> None:
        """Every folder's check (see OutputFolder.check); a part may not be a file. Creates nothing."""
        for folder, _ in self.parts:
            if os.path.lexists(folder.path) and not os.path.isdir(folder.path):
                raise ValueError(f"{folder.flag} {folder.given} is a file, not a folder; remove it or pick another "
                                 f"{folder.flag}")
        for folder in self.folders:
            folder.check()

    @contextlib.contextmanager
    def open(self) -> Iterator[OutputFolders]:
        """Check every folder, then open (create, mark, lease) each in turn; yields self. A failure on one gives
        back the ones already opened (and removes what they created, as OutputFolder.open does)."""
        self.check()
        with contextlib.ExitStack() as stack:
            for folder in self.folders:
                stack.enter_context(folder.open())
            yield self

    def check_lease(self) -> None:
        """LeaseLost when another writer took any of the folders over."""
        for folder in self.folders:
            folder.check_lease()


def output_folder_at(path: str, *, command: str, flag: str, inputs: Mapping[str, str | None] | None = None,
                     storage_options: Mapping | None = None, legacy_markers: tuple[str, ...] = (),
                     break_lease: bool = False) -> OutputFolder | RemoteOutputFolder:
    """The guard of an output flag that takes a local folder or an object-store URL: an OutputFolder for a local
    path, a RemoteOutputFolder for a URL (s3://, gs://, ...)."""
    if str(path).strip() and _local(path) is None:
        return RemoteOutputFolder(path, command=command, flag=flag, inputs=inputs, storage_options=storage_options,
                                  break_lease=break_lease)
    return OutputFolder(path, command=command, flag=flag, inputs=inputs, legacy_markers=legacy_markers,
                        break_lease=break_lease)
