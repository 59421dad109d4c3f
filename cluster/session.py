"""The Ray session of an `hsx` command, for jobs and `hsx serve` alike: connect or start, probe, fit resources.

    ray_cluster(address, quiet=)   context manager: the session's Ray if connected, `address` / $RAY_ADDRESS
                              (probed first: an unreachable address fails in one line), else a private local Ray
                              started here; yields True when it was started here (its resources are all there will
                              be). quiet: Ray's own console output stays in its session logs
    ray_logs_dir()            where those logs are on this machine, while connected
    gpus_default()            1 when the cluster has a GPU, else 0 (what a worker or replica takes by default)
    check_fits(problems, local=, fix=, waiting=)   resources a command needs and the cluster lacks: an error on a
                              private local Ray, a warning on a cluster that may autoscale
    first_line(error)         an exception's first line, for one-line Ray errors
    RayStartFailed            a private local Ray did not start (a RuntimeError the CLI prints in one line, exit 1)

Ray itself is imported where it is used (a command's --help never loads it); the quiet console's filter of Ray's
C++ core lines is cluster/console.py's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator

from cluster.console import core_echo_off

logger = logging.getLogger(__name__)


class RayStartFailed(RuntimeError):
    """The private local Ray of a command did not start (its node timed out on a loaded machine, a port taken...):
    the work failed, in one line (`hsx` exits 1), not a bug's traceback."""


@contextlib.contextmanager
def ray_cluster(address: str | None, quiet: bool = False) -> Iterator[bool]:
    """Connect to Ray: the session's if already connected, `address` or $RAY_ADDRESS, else a private local one
    started here — also when a `ray start` cluster runs on this machine (or left its address file behind): that one
    is used only when asked for (--address auto). ValueError (exit 2) when the given address cannot be reached.

    `quiet`: the console gets hsx's lines alone. Ray's own stay in its session logs (ray_logs_dir()): its workers'
    output (not forwarded), its driver's notices and warnings (logged at ERROR only), its C++ core's error echo
    (cluster.console.core_echo_off). Errors still reach the driver as exceptions, and "(raylet)" messages (a worker killed, out of
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
            with core_echo_off() if quiet else contextlib.nullcontext():
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
        try:
            with core_echo_off() if quiet else contextlib.nullcontext():
                ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, **console)
        except Exception as e:  # noqa: BLE001 - Ray raises a plain Exception when its node times out starting
            with contextlib.suppress(Exception):
                ray.shutdown()  # what was half started
            raise RayStartFailed(f"a private local Ray could not start ({first_line(e)}); the machine may be "
                                 "overloaded: retry when it is quieter, or start one with `ray start --head` and pass "
                                 "--address auto") from e
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
