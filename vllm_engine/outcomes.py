"""What became of each file the plug-in wrote, told back to the process that asked for it.

vLLM returns a request's output once the request finishes; the plug-in writes its file a step later, in vLLM's
worker process (vllm_engine/connector.py). An engine that must not report a sample "ok" before its file is durable
(vllm_engine/engine.py, hsx's jobs) tags each request with a ticket (`kv_transfer_params["hsx_ticket"]`) and asks
the workers for the tickets' outcomes through vLLM's `collective_rpc`:

    record(ticket, error_kind, error)    the plug-in, once a file is durable (None, None) or failed
    HsxWorkerExtension.hsx_outcomes(tickets) -> {ticket: (error_kind, error)}   taken (forgotten) when read; loaded
                                         into vLLM's workers by `worker_extension_cls` (EXTENSION)

A bounded number of outcomes is kept (OUTCOMES_KEPT, oldest dropped first): plain `vllm serve` users, who never ask,
do not grow the worker's memory. Imports nothing of vLLM.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

EXTENSION = "vllm_engine.outcomes.HsxWorkerExtension"
"""vLLM's `worker_extension_cls` that adds `hsx_outcomes` to its workers."""
OUTCOMES_KEPT = 65536
TICKET = "hsx_ticket"
"""The kv_transfer_params key of a request's ticket."""

_outcomes: OrderedDict[str, tuple[str | None, str | None]] = OrderedDict()
_lock = threading.Lock()


def record(ticket: str | None, error_kind: str | None = None, error: str | None = None) -> None:
    """The outcome of the file of the request tagged `ticket` (nothing for an untagged one)."""
    if not ticket:
        return
    with _lock:
        _outcomes[str(ticket)] = (error_kind, error)
        while len(_outcomes) > OUTCOMES_KEPT:
            _outcomes.popitem(last=False)


def take(tickets: list[str]) -> dict[str, tuple[str | None, str | None]]:
    """The known outcomes among `tickets`, forgotten once read."""
    with _lock:
        return {t: _outcomes.pop(t) for t in tickets if t in _outcomes}


class HsxWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls=EXTENSION`): `collective_rpc("hsx_outcomes", ...)`."""

    def hsx_outcomes(self, tickets: list[str]) -> dict[str, tuple[str | None, str | None]]:
        return take(list(tickets))
