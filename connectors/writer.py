"""Background writes: a thread pool with a bound on the memory its pending writes keep alive.

    submit(buffers, fn, *args) -> Future  blocks while the bound is full (a fast producer waits, memory stays flat)
    drain()                               block until every submitted write has finished
    shutdown()
    name_os_thread(name)                  the calling thread's OS-level name (top -H, ps -L)
    named_thread_pool(n, name)            a ThreadPoolExecutor whose threads carry `name` in Python and the OS:
                                          the writers are hsx-writer, serve's engine thread hsx-engine

`buffers` is what the write keeps alive until it is done: {key: nbytes} of the buffers its tensors view. A buffer
shared by several pending writes (the rows of one batch are views of one batch tensor) counts once, whole, from the first write that holds it until the last one finishes: the bound is on memory held, not on
the bytes each file will have. A write that adds no new buffer is never held back; one larger than the whole bound
is admitted alone, so nothing deadlocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux: prctl PR_SET_NAME, at most 15 bytes; shown by top -H, ps -L
    and /proc/<pid>/task/<tid>/comm). Threads it starts inherit the name until they set their own. A no-op
    elsewhere."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        pass


def named_thread_pool(max_workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads are named `name` for Python (thread_name_prefix) and the OS (name_os_thread)."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name, initializer=name_os_thread,
                              initargs=(name,))


class BackgroundWriter:
    def __init__(self, num_threads: int, max_bytes_in_flight: int) -> None:
        if num_threads < 1:
            raise ValueError(f"num_writer_threads must be >= 1, got {num_threads}")
        if max_bytes_in_flight < 1:
            raise ValueError(f"max_bytes_in_flight must be >= 1, got {max_bytes_in_flight}")
        self._pool = named_thread_pool(num_threads, "hsx-writer")
        self._max = max_bytes_in_flight
        self._in_flight = 0
        self._held: dict[Hashable, list[int]] = {}  # buffer key -> [pending writes holding it, nbytes]
        self._pending: set[Future] = set()
        self._cond = threading.Condition()
        self.peak_bytes_in_flight = 0

    def submit(self, buffers: Mapping[Hashable, int], fn: Callable, *args, **kwargs) -> Future:
        held = dict(buffers)

        def admissible() -> bool:
            new = sum(n for key, n in held.items() if key not in self._held)
            return new == 0 or self._in_flight == 0 or self._in_flight + new <= self._max

        with self._cond:
            self._cond.wait_for(admissible)
            for key, nbytes in held.items():
                if key in self._held:
                    self._held[key][0] += 1
                else:
                    self._held[key] = [1, nbytes]
                    self._in_flight += nbytes
            self.peak_bytes_in_flight = max(self.peak_bytes_in_flight, self._in_flight)
        try:
            future = self._pool.submit(fn, *args, **kwargs)
        except BaseException:
            self._release(held)
            raise
        with self._cond:
            self._pending.add(future)
        future.add_done_callback(lambda f: self._release(held, f))
        return future

    def _release(self, held: Mapping[Hashable, int], future: Future | None = None) -> None:
        with self._cond:
            for key in held:
                entry = self._held[key]
                entry[0] -= 1
                if entry[0] == 0:
                    self._in_flight -= entry[1]
                    del self._held[key]
            self._pending.discard(future)
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every submitted write; True when none is left."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and self._in_flight == 0, timeout=timeout)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
