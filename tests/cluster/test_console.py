"""The quiet console's filter of Ray's C++ core lines (cluster/console.py), in a process of its own: the core's info,
warning and error lines are dropped, a fatal line and the stack trace after it still reach the console when the
process dies (the filter outlives it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from cluster.console import CORE_ECHO_DROPPED

FATAL_AFTER_QUIET_INIT = """
import ctypes, os
from cluster.console import core_echo_off
libc = ctypes.CDLL(None)
libc.fprintf.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
with core_echo_off():  # what ray.init does in there: the core's logger keeps C's stderr stream of that moment
    held = ctypes.c_void_p.in_dll(libc, "stderr").value
libc.fprintf(held, b"[2026-12-06 07:15:39,821 E 7 7] core_worker.cc:2465: Actor ... has constructor arguments\\n")
libc.fprintf(held, b"[2026-12-06 07:15:40,002 C 7 7] core_worker.cc:911: Check failed: the GCS is gone\\n")
libc.fprintf(held, b"*** SIGABRT received at time=1765000000 on cpu 0 ***\\n")
os.abort()
"""


def test_a_fatal_line_of_the_driver_core_still_reaches_the_quiet_console():
    # hostile input: the driver's C++ core dying after a quiet ray.init (issue 49 item 9); on 6c0b8cf its stream
    # was /dev/null for the process's life, so the cause of the crash reached no console
    done = subprocess.run([sys.executable, "-c", FATAL_AFTER_QUIET_INIT], capture_output=True, text=True,
                          timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == -6  # SIGABRT
    assert "Check failed: the GCS is gone" in done.stderr and "*** SIGABRT received" in done.stderr, done.stderr
    assert "constructor arguments" not in done.stderr  # the false alarm the quiet console exists for


def test_the_dropped_pattern_takes_the_cores_info_warning_and_error_lines_alone():
    drop = re.compile(CORE_ECHO_DROPPED)
    for level in "IWE":
        assert drop.match(f"[2026-12-06 07:15:39,821 {level} 22809 22809] core_worker.cc:12: a notice")
    assert not drop.match("[2026-12-06 07:15:39,821 C 22809 22809] core_worker.cc:911: Check failed: x")
    assert not drop.match("*** SIGABRT received at time=1765000000 on cpu 0 ***")
    assert not drop.match("Traceback (most recent call last):")
