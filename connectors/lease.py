"""One writer per output: OUTPUT/writer.lease, taken before run.json is written or checked, renewed while the job
runs, given back when it ends.

    WriterLease.acquire(run, attempt, break_lease=False) -> WriterLease    or LeaseHeld (a usage error, exit 2)
    lease.renew()             re-writes the lease with a fresh time; LeaseLost if another writer took it over
    lease.keep_alive()        context manager: renews every RENEW_EVERY_S on a background thread
    lease.release()
    live_writer(run) -> str | None   a reader's question: who writes this output now (None: nobody, or a stale lease)
    snapshot_writer(run, snapshot=, what=, harm=, doing=) -> str | None
                                     a reader's gate (export, train-drafter, report): a live writer refused unless
                                     --snapshot, which reads what it committed so far

The lease is a small JSON object ({"attempt", "host", "pid", "started", "renewed"}) created with an exclusive create
(`storage.create_exclusive`: a hard link on local disks, If-None-Match on S3, ifGenerationMatch=0 on GCS), so of two
`hsx run` started on one output at once exactly one gets it; the other exits 2 naming the holder. A lease left by a
job that died is stale and is broken, with a warning, when its process is gone (same host) or it was not renewed for
STALE_AFTER_S (any host); `--break-lease` breaks a lease that looks live (its holder is known to be gone). Breaking
is re-checked against the lease's content right before it is removed, and every renewal checks that the lease is
still ours, so a job whose lease was taken over stops before it commits more rows.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

from connectors import storage
from connectors.run import RunDir

logger = logging.getLogger(__name__)

LEASE_FILE = "writer.lease"
RENEW_EVERY_S = 30.0
STALE_AFTER_S = 300.0
_HELD: set[str] = set()
"""Attempts whose lease a live WriterLease of this process holds (a lease of this pid not in it was dropped)."""


class LeaseHeld(ValueError):
    """Another job writes this output now; running a second writer would duplicate its samples."""


class LeaseLost(RuntimeError):
    """This job's lease was broken and taken by another writer; it must stop committing."""


@dataclass(frozen=True)
class _Holder:
    attempt: str
    host: str
    pid: int
    started: float
    renewed: float

    @classmethod
    def parse(cls, raw: bytes) -> _Holder | None:
        try:
            doc = json.loads(raw)
            return cls(str(doc["attempt"]), str(doc["host"]), int(doc["pid"]), float(doc["started"]),
                       float(doc["renewed"]))
        except (ValueError, KeyError, TypeError, RecursionError):
            return None  # unreadable: treated as stale by age of the file alone

    def describe(self, now: float) -> str:
        return (f"attempt {self.attempt} on host {self.host} (pid {self.pid}), started "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(self.started))} UTC, last renewed "
                f"{now - self.renewed:.0f} s ago")

    def gone(self, now: float) -> str | None:
        """Why this holder is known to be gone, or None when it may be alive."""
        if self.host == socket.gethostname():
            if self.pid == os.getpid():
                return None if self.attempt in _HELD else "it was taken by this process and dropped"
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return f"its process {self.pid} no longer runs"
            except PermissionError:
                pass  # alive, another user's
        if now - self.renewed > STALE_AFTER_S:
            return f"it was not renewed for {now - self.renewed:.0f} s (stale after {STALE_AFTER_S:.0f} s)"
        return None


class WriterLease:
    def __init__(self, run: RunDir, attempt: str, started: float) -> None:
        self.run = run
        self.attempt = attempt
        self.started = started
        self._stop = threading.Event()
        _HELD.add(attempt)
        weakref.finalize(self, _HELD.discard, attempt)

    def _body(self, now: float) -> bytes:
        return _body(self.attempt, self.started, now)

    @classmethod
    def acquire(cls, run: RunDir, attempt: str, *, break_lease: bool = False, command: str = "hsx run",
                harm: str = "Two writers would extract every sample twice") -> WriterLease:
        """Take the output's lease, breaking a stale one; LeaseHeld when a live job holds it. `command` and `harm`
        name the writer and what a second one would do, in that message (an output folder of `hsx train-drafter`
        or `hsx export` takes the same lease, see connectors.outputs)."""
        path = run.path(LEASE_FILE)
        for _ in range(3):  # a broken lease may be re-taken by a racing writer between our remove and create
            now = time.time()
            if storage.create_exclusive(run.fs, path, _body(attempt, now, now)):
                return cls(run, attempt, now)
            try:
                raw = run.read_bytes(LEASE_FILE)
            except FileNotFoundError:
                continue  # released meanwhile: try again
            holder = _Holder.parse(raw)
            reason = "its lease file is unreadable" if holder is None else holder.gone(now)
            if reason is None and not break_lease:
                raise LeaseHeld(f"{run.url} is being written by another {command}: {holder.describe(now)}. {harm}; "
                                "wait for it to finish, or, if that process is gone (its machine died), re-run with "
                                "--break-lease")
            logger.warning("breaking the lease on %s (%s): %s", run.url, "--break-lease" if reason is None else
                           reason, raw.decode("utf-8", "replace")[:200])
            _remove_if_unchanged(run, raw)
        raise LeaseHeld(f"could not take the lease on {run.url}: other writers keep taking it; is another {command} "
                        "starting on this output right now?")

    def renew(self) -> None:
        """Write a fresh renewal time; LeaseLost when the lease is no longer ours."""
        try:
            holder = _Holder.parse(self.run.read_bytes(LEASE_FILE))
        except FileNotFoundError:
            holder = None
        if holder is None or holder.attempt != self.attempt:
            raise LeaseLost(f"the writer lease on {self.run.url} was taken over"
                            + (f" by {holder.describe(time.time())}" if holder else " (removed)")
                            + "; this job stops committing so that two writers never duplicate samples")
        self.run.put(LEASE_FILE, self._body(time.time()))

    @contextlib.contextmanager
    def keep_alive(self, every_s: float = RENEW_EVERY_S) -> Iterator[threading.Event]:
        """Renew in the background while the body runs; yields an Event that is set if the lease is lost."""
        lost = threading.Event()

        def loop() -> None:
            while not self._stop.wait(every_s):
                try:
                    self.renew()
                except LeaseLost as e:
                    logger.error("%s", e)
                    lost.set()
                    return
                except Exception as e:  # noqa: BLE001 - storage hiccups: retried at the next renewal
                    logger.warning("could not renew the writer lease on %s: %s", self.run.url, e)

        thread = threading.Thread(target=loop, name="hsx-lease", daemon=True)
        thread.start()
        try:
            yield lost
        finally:
            self._stop.set()
            thread.join()

    def release(self) -> None:
        """Give the lease back (only if it is still ours); idempotent. Never raises: a lease that cannot be removed
        (storage gone) is left to go stale, and the job's own outcome is what the user needs to see."""
        self._stop.set()
        _HELD.discard(self.attempt)
        try:
            raw = self.run.read_bytes(LEASE_FILE)
            holder = _Holder.parse(raw)
            if holder is not None and holder.attempt == self.attempt:
                _remove_if_unchanged(self.run, raw)
        except FileNotFoundError:
            return
        except Exception as e:  # noqa: BLE001 - see docstring
            logger.warning("could not give back the writer lease on %s (%s); it goes stale in %.0f s",
                           self.run.url, e, STALE_AFTER_S)


def live_writer(run: RunDir) -> str | None:
    """The holder of a live writer lease on `run`, described for a message, or None when no writer is live (no lease,
    or one whose holder is gone or stale by the same rules acquire() breaks it by). Readers that would take a
    snapshot of a run being written (export, train-drafter, report) ask this first."""
    try:
        raw = run.read_bytes(LEASE_FILE)
    except FileNotFoundError:
        return None
    now = time.time()
    holder = _Holder.parse(raw)
    if holder is None or holder.gone(now) is not None:
        return None
    return holder.describe(now)


def snapshot_writer(run: RunDir, *, snapshot: bool, what: str, harm: str, doing: str) -> str | None:
    """The live writer of `run`, described, when `snapshot` (--snapshot) lets a reader take what it has committed so
    far; None when no writer is live. Without --snapshot a live writer is a ValueError naming it, `harm` (what a
    reading now would get wrong) and the fix; `what` names the run as the command's flag does, `doing` what
    --snapshot then does."""
    writer = live_writer(run)
    if writer is None:
        return None
    if not snapshot:
        raise ValueError(f"{what} is being written now by {writer}: {harm}; wait for that writer (hsx run, verify or "
                         f"compact) to finish, or pass --snapshot to {doing}")
    logger.warning("--snapshot: %s is being written by %s; %s", what, writer, doing)
    return writer


def _body(attempt: str, started: float, now: float) -> bytes:
    return json.dumps({"attempt": attempt, "host": socket.gethostname(), "pid": os.getpid(), "started": started,
                       "renewed": now}).encode()


def _remove_if_unchanged(run: RunDir, seen: bytes) -> None:
    """Remove the lease file if it still holds `seen` (narrows the window in which a newer lease could be removed)."""
    with contextlib.suppress(FileNotFoundError):
        if run.read_bytes(LEASE_FILE) == seen:
            run.fs.rm_file(run.path(LEASE_FILE))
