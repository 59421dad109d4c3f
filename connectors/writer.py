"""Background writes: a thread pool with a bound on bytes in flight.

    submit(nbytes, fn, *args) -> Future   blocks while the bound is full (a fast producer waits, memory stays flat)
    drain()                               block until every submitted write has finished
    shutdown()

One write larger than the whole bound is admitted alone, so nothing deadlocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class BackgroundWriter:
    def __init__(self, num_threads: int, max_bytes_in_flight: int) -> None:
        if num_threads < 1:
            raise ValueError(f"num_writer_threads must be >= 1, got {num_threads}")
        if max_bytes_in_flight < 1:
            raise ValueError(f"max_bytes_in_flight must be >= 1, got {max_bytes_in_flight}")
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="hsx-writer")
        self._max = max_bytes_in_flight
        self._in_flight = 0
        self._pending: set[Future] = set()
        self._cond = threading.Condition()
        self.peak_bytes_in_flight = 0

    @property
    def bytes_in_flight(self) -> int:
        with self._cond:
            return self._in_flight

    def submit(self, nbytes: int, fn: Callable, *args, **kwargs) -> Future:
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight == 0 or self._in_flight + nbytes <= self._max)
            self._in_flight += nbytes
            self.peak_bytes_in_flight = max(self.peak_bytes_in_flight, self._in_flight)
        try:
            future = self._pool.submit(fn, *args, **kwargs)
        except BaseException:
            self._release(nbytes)
            raise
        with self._cond:
            self._pending.add(future)
        future.add_done_callback(lambda f: self._release(nbytes, f))
        return future

    def _release(self, nbytes: int, future: Future | None = None) -> None:
        with self._cond:
            self._in_flight -= nbytes
            self._pending.discard(future)
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every submitted write; True when none is left."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and self._in_flight == 0, timeout=timeout)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
