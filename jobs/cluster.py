"""The Ray session of an `hsx` command, for jobs and `hsx serve` alike.

    ray_cluster(address, quiet=)   context manager: the session's Ray if connected, `address` / $RAY_ADDRESS
                              (probed first: an unreachable address fails in one line), else a private local Ray
                              started here; yields True when it was started here (its resources are all there will
                              be). quiet: Ray's own console output stays in its session logs
    ray_logs_dir()            where those logs are on this machine, while connected
    gpus_default()            1 when the cluster has a GPU, else 0 (what a worker or replica takes by default)
    check_fits(problems, local=, fix=, waiting=)   resources a command needs and the cluster lacks: an error on a
                              private local Ray, a warning on a cluster that may autoscale
    first_line(error)         an exception's first line, for one-line Ray errors
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def ray_cluster(address: str | None, quiet: bool = False) -> Iterator[bool]:
    """Connect to Ray: the session's if already connected, `address` or $RAY_ADDRESS, else a private local one
    started here — also when a `ray start` cluster runs on this machine (or left its address file behind): that one
    is used only when asked for (--address auto). ValueError (exit 2) when the given address cannot be reached.

    `quiet`: the console gets hsx's lines alone. Ray's own stay in its session logs (ray_logs_dir()): its workers'
    output (not forwarded), its driver's notices and warnings (logged at ERROR only), its C++ core's error echo
    (_core_echo_off). Errors still reach the driver as exceptions, and "(raylet)" messages (a worker killed, out of
    memory) are printed as before. Off: Ray's console output as Ray prints it (`hsx run --verbose`).

    Yields True when the cluster was started here (its resources are all there will be).
    """
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        _probe(address)  # also when this process is connected already: an address nothing answers is an error
    if ray.is_initialized():
        yield False
        return
    console = {"logging_level": logging.ERROR, "log_to_driver": False} if quiet else \
        {"logging_level": logging.WARNING}
    if address:
        try:
            with _core_echo_off() if quiet else contextlib.nullcontext():
                ray.init(address=address, **console)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ValueError(f"--address {address}: cannot connect to a Ray cluster there ({first_line(e)}). "
                             f"{_ADDRESS_FIX}") from e
    else:
        existing = _existing_local_cluster()
        if existing:
            logger.warning("a Ray cluster started with `ray start` is registered on this machine (%s); this job "
                           "starts a private local Ray instead. Pass --address auto to run on that cluster", existing)
        # at least 4 logical CPUs: read tasks, tokenizer actors and workers must fit at once on a small machine
        with _core_echo_off() if quiet else contextlib.nullcontext():
            ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, **console)
    try:
        yield not address
    finally:
        ray.shutdown()


def ray_logs_dir() -> str | None:
    """This machine's folder of Ray's session logs (workers' worker-*.out/.err, python-core-driver-*.log, ray-data/),
    while connected; None when Ray does not say."""
    import ray

    try:
        return ray._private.worker._global_node.get_logs_dir_path()  # no public API names it (Ray 2.60)
    except AttributeError:
        return None


@contextlib.contextmanager
def _core_echo_off() -> Iterator[None]:
    """While ray.init starts the driver's C++ core, C's `stderr` stream is a filter: its logger picks the stream it
    echoes lines to then (and writes every line to the session's python-core-driver-*.log as well). Ray has no
    setting for that echo (RAY_BACKEND_LOG_LEVEL=fatal would empty every C++ log file of the cluster, and prints a
    line of its own), and Ray Data's actor pools always trip one false alarm there ("constructor arguments in the
    object store and max_restarts > 0", ray-project/ray#57733). The filter (_core_echo_filter) drops the core's
    info, warning and error lines and passes everything else to the console: a FATAL line and the stack trace after
    it still say why the process died. Python's sys.stderr (fd 2) is untouched. glibc only (what Ray's Linux wheels
    need); elsewhere nothing changes."""
    import ctypes
    import platform

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
    import ctypes
    import subprocess
    import sys

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


def _existing_local_cluster() -> str | None:
    """The address a `ray start` on this machine recorded ($RAY_TMPDIR or /tmp, then ray/ray_current_cluster, as
    Ray looks it up), if any."""
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    path = os.path.join(base, "ray", "ray_current_cluster")
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


_ADDRESS_FIX = ("Check the address (HOST:6379, the head's GCS port; ray://HOST:10001; or auto) and that the "
                "cluster runs, or leave --address out to run on a private local Ray")


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast (ValueError) when a HOST:PORT or ray://HOST:PORT address refuses connections or does not answer
    gRPC, the protocol of Ray's GCS and client server: Ray itself keeps retrying an unreachable GCS for minutes, and
    a listener that is not Ray (the dashboard's 8265, a web server) accepts the TCP connection all the same."""
    import socket

    import grpc  # shipped with Ray (its GCS and client protocol)

    target = address.split("://", 1)[-1].rsplit("/", 1)[0]
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or address.startswith(("http://", "https://")):
        return  # "auto", "local", or a form Ray resolves (or refuses) itself
    host = host.strip("[]") or "127.0.0.1"
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"--address {address}: cannot connect to a Ray cluster there ({e}). {_ADDRESS_FIX}") from None
    channel = grpc.insecure_channel(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise ValueError(f"--address {address}: something listens there but it is not Ray (no gRPC answer in "
                         f"{timeout_s:g} s). {_ADDRESS_FIX}") from None
    finally:
        channel.close()


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def gpus_default() -> float:
    """What a worker or replica reserves when its GPUs are not given: one GPU where the cluster has one."""
    import ray

    return 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0


def check_fits(problems: list[str], *, local: bool, fix: str, waiting: str) -> None:
    """Resources a command needs beyond the cluster's now (`problems`, one phrase each): ValueError naming `fix` on a
    private local Ray (nothing will be added), else a warning ending with `waiting` (another cluster may autoscale,
    and Ray exposes no reliable "no autoscaler" signal)."""
    if not problems:
        return
    msg = "; ".join(problems) + "; " + fix
    if local:
        raise ValueError(msg)
    logger.warning("%s (%s)", msg, waiting)
