"""The hidden-states connector interface: how an engine hands captured hidden states to storage.

Modelled on vLLM's KV-connector base class, reduced to the producer side hsx needs. Grouped by who calls it:

Engine, per request (in this order):
    start_request(request)                 a request enters; decide and check its destination. Raises ValueError
                                           (e.g. a rejected custom path) to fail that request alone, writing nothing.
    save_hidden_states(rid, ids, states, extra=)
                                           captured rows arrive: a prefill chunk, then one row per decode step;
                                           `extra`: the same rows of the further per-token tensors the spec's
                                           files carry (a top-k target's ids and log-probabilities [t, K]).
    request_finished(rid) -> dict          no more rows; persisting starts; returns the `kv_transfer_params` for
                                           the request's output (at least {"hidden_states_path": ...}).
    abort_request(rid)                     optional: drop what was buffered for a request that failed.
    write_seconds(rid) -> float | None     optional: how long the request's file took to become durable.
    forget(path)                           optional: a file this connector wrote was removed; its path is free.

Engine, per batch / lifetime:
    wait_for_save() -> {rid: error}        block until every started save is durable; report those that failed.
    shutdown()                             optional: flush and release threads.

Only the core methods are abstract; optional hooks default to doing nothing sensible, so adding a hook never breaks
an implementation. NullConnector writes nothing: the connector of a speculative-decoding engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connectors.format import HiddenStatesSpec

if TYPE_CHECKING:
    import torch  # annotations only: the interface makes no tensors


@dataclass
class RequestInfo:
    """What the connector learns about a request when it starts."""

    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: Mapping[str, Any] = field(default_factory=dict)
    """The request's own params: `hidden_states_path`, `include_output_tokens`."""
    sample_id: str | None = None
    """A corpus-level id (jobs); recorded in the file's metadata."""
    loss_mask: torch.Tensor | None = None
    """[num_prompt_tokens] 0/1 over prompt tokens; rows beyond the prompt (output tokens) count as 1."""
    prompt_rows: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Per-prompt-token tensors the file keeps beside the states (an image prompt's mm_token_type_ids [P] and
    position_ids [P, 3]; connectors.format.PROMPT_ROW_FILL says how output tokens extend them)."""
    request_tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Tensors kept as they are (an image prompt's mm_embeds [N, H], when the connector stores them)."""


class HiddenStatesConnector(ABC):
    """Persists captured hidden states, one file per request. See the module docstring for the call order."""

    #: dataclass type parsed from `kv_connector_extra_config`; unknown keys are rejected with the valid list.
    extra_config_class: type | None = None

    def __init__(self, extra_config: Any, spec: HiddenStatesSpec) -> None:
        self.extra_config = extra_config
        self.spec = spec

    # -- engine, per request ------------------------------------------------------------------------------------
    def writes(self, kv_transfer_params: Mapping[str, Any] | None) -> bool:
        """Whether a request writes a file, given its kv_transfer_params (None: it sent none). Every request does,
        unless the connector's `files` setting is "requested": then only those that sent them."""
        return kv_transfer_params is not None or getattr(self.extra_config, "files", "all") == "all"

    @abstractmethod
    def start_request(self, request: RequestInfo) -> None:
        """Accept a request; raise ValueError to fail it alone, with nothing written."""

    @abstractmethod
    def save_hidden_states(self, request_id: str, token_ids: torch.Tensor, hidden_states: torch.Tensor,
                           extra: Mapping[str, torch.Tensor] | None = None) -> None:
        """Append captured rows: token_ids [t] and hidden_states [t, L, H] (on CPU), and `extra` {name: [t, ...]}
        when the spec's files carry more per-token tensors (`connectors.header.extra_row_entries`).

        The connector may keep the tensors themselves (not copies) until the request's file is written, after
        request_finished; do not modify them in place afterwards (a fresh tensor per call is the normal case).
        """

    @abstractmethod
    def request_finished(self, request_id: str) -> dict[str, Any]:
        """Start persisting the request; return its output `kv_transfer_params`."""

    def abort_request(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """Forget a request that failed before finishing."""

    def write_seconds(self, request_id: str) -> float | None:
        """Seconds the request's file took from request_finished to durable, once it is (None: not measured)."""
        return None

    def forget(self, path: str) -> None:  # noqa: B027 - optional hook
        """A file this connector wrote was removed: requests may write that path again."""

    # -- engine, per batch / lifetime ---------------------------------------------------------------------------
    @abstractmethod
    def wait_for_save(self, timeout: float | None = None) -> dict[str, BaseException]:
        """Block until started saves are durable; return {request_id: error} for those that failed."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Flush and release resources."""

    @classmethod
    def parse_extra_config(cls, extra: Mapping[str, Any]) -> Any:
        """Validate `kv_connector_extra_config` for this connector (an instance of extra_config_class passes as is)."""
        if cls.extra_config_class is None:
            return dict(extra)
        if isinstance(extra, cls.extra_config_class):
            return extra
        return cls.extra_config_class.from_mapping(extra)


class NullConnector(HiddenStatesConnector):
    """Writes nothing: the connector of an engine that decodes speculatively (extraction is another engine), or of one
    that only generates (KVTransferConfig(kv_connector="NullConnector"): `hsx serve --no-files` without --output);
    no request writes a file, so nothing is captured for one."""

    def __init__(self, extra_config: Any = None, spec: HiddenStatesSpec | None = None) -> None:
        super().__init__(extra_config, spec)

    def writes(self, kv_transfer_params: Mapping[str, Any] | None) -> bool:
        return False

    def start_request(self, request: RequestInfo) -> None:
        pass

    def save_hidden_states(self, request_id: str, token_ids: torch.Tensor, hidden_states: torch.Tensor,
                           extra: Mapping[str, torch.Tensor] | None = None) -> None:
        pass

    def request_finished(self, request_id: str) -> None:  # no file: the output gets no kv_transfer_params
        return None

    def wait_for_save(self, timeout: float | None = None) -> dict[str, BaseException]:
        return {}
