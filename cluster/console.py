"""Ray's C++ core on a quiet console: while `ray.init` starts the driver's core, C's `stderr` stream is a pipe to a
small filter process that drops the core's info, warning and error lines and passes everything else (a FATAL line and
the stack trace after it still say why the process died). Used by cluster.session.ray_cluster(quiet=True).

    core_echo_off()         context manager: C's `stderr` is the filter while it is open (glibc only; elsewhere a
                            no-op)
    CORE_ECHO_DROPPED       the pattern of the lines dropped
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def core_echo_off() -> Iterator[None]:
    """While ray.init starts the driver's C++ core, C's `stderr` stream is a filter: its logger picks the stream it
    echoes lines to then (and writes every line to the session's python-core-driver-*.log as well). Ray has no
    setting for that echo (RAY_BACKEND_LOG_LEVEL=fatal would empty every C++ log file of the cluster, and prints a
    line of its own), and Ray Data's actor pools always trip one false alarm there ("constructor arguments in the
    object store and max_restarts > 0", ray-project/ray#57733). The filter (_core_echo_filter) drops the core's
    info, warning and error lines and passes everything else to the console: a FATAL line and the stack trace after
    it still say why the process died. Python's sys.stderr (fd 2) is untouched. glibc only (what Ray's Linux wheels
    need); elsewhere nothing changes."""
    filtered = _core_echo_filter() if platform.libc_ver()[0] == "glibc" else None
    if not filtered:
        yield
        return
    stream = ctypes.c_void_p.in_dll(ctypes.CDLL(None), "stderr")
    saved = stream.value
    stream.value = filtered
    try:
        yield
    finally:
        stream.value = saved


CORE_ECHO_DROPPED = r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [IWE] \d+ \d+\] "
"""The driver core's info / warning / error lines (`[2026-12-06 07:15:39,821 E 22809 22809] file.cc:12: ...`),
which the quiet console drops; fatal lines (`C`), stack traces and anything else pass."""
_FILTER = ("import re, sys\n"
           f"drop = re.compile({CORE_ECHO_DROPPED.encode()!r})\n"
           "for line in sys.stdin.buffer:\n"
           "    if not drop.match(line):\n"
           "        sys.stderr.buffer.write(line)\n"
           "        sys.stderr.buffer.flush()\n")


_FILTER_PROCESS: list = []


@functools.cache
def _core_echo_filter() -> int | None:
    """A C `FILE *` (line-buffered) on a pipe read by a small filter process that writes what passes to this
    process's stderr (None if it cannot be started). A process of its own, so that the line a dying driver writes
    last still reaches the console after the driver is gone: the filter ends when the pipe's last writer closes.
    Opened once and never closed: Ray's logger keeps writing to it for the process's life."""
    try:
        read, write = os.pipe()  # not inherited by Ray's own processes (O_CLOEXEC)
        _FILTER_PROCESS.append(subprocess.Popen(  # kept: reaped at exit, no "still running" ResourceWarning
            [sys.executable, "-S", "-c", _FILTER], stdin=read, stdout=subprocess.DEVNULL,
            start_new_session=True))  # Ctrl-C reaches hsx, not the filter: it ends at end of input
        os.close(read)
    except OSError as e:
        logger.debug("no filter for Ray's core console lines (%s); they are shown as they come", e)
        return None
    libc = ctypes.CDLL(None)
    libc.fdopen.restype = ctypes.c_void_p
    libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
    libc.setvbuf.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t]
    stream = libc.fdopen(write, b"w")
    if stream:
        libc.setvbuf(stream, None, 1, 0)  # _IOLBF: a line reaches the filter when it is written
    return stream
