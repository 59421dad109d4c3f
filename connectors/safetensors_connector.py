"""`SafetensorsHiddenStatesConnector`: hsx's connector, one safetensors file per request on any fsspec storage.

Writes `token_ids` [T], `hidden_states` [T, L, H] (in the spec's storage dtype: fp8 with `hidden_states_scales`
[T, L, 1], see connectors.quant), optional `loss_mask` [T], and metadata from the producer's `HiddenStatesSpec` — to a local folder or any fsspec URL, off the compute path (background writer threads, a bound on
the bytes in flight, retries, durable atomic files). Each file's metadata carries the checksum of its data
(`"checksum": "xxh3_64:<16 hex>"`), computed on the writer threads by `connectors.safetensors_file.write_atomic`; the
metadata built here holds a placeholder of the same length, so `connectors.format.file_size` predicts the file.
States holding NaN, Inf or a layer of zeros are never committed: the request fails with `connectors.quant.BadStates`
naming the token and layer (`check_states`).

Where a file may go is decided twice: when a request starts (`connectors.paths.PathPolicy`: inside an allowed root;
`PathOwners`: no other request owns it, see kv_transfer_params["overwrite"]) and again when it is written, from the
allowed root the request's path lies in, following no symlink (`connectors.storage.local_parent`).

Registered as "SafetensorsHiddenStatesConnector", and under vLLM's name "ExampleHiddenStatesConnector" (plus the
older "HsxHiddenStatesConnector"); `connectors.example_hidden_states_connector` is the vLLM-compatible module alias
that also offers `load_hidden_states` / `cleanup_hidden_states`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors import safetensors_file, storage
from connectors.base import HiddenStatesConnector, RequestInfo
from connectors.format import (
    HIDDEN_STATES,
    HIDDEN_STATES_SCALES,
    LOSS_MASK,
    TARGET_TOPK_LOGPROBS,
    TOKEN_IDS,
    HiddenStatesSpec,
    extra_row_entries,
    request_metadata,
)
from connectors.paths import Destination, PathOwners, PathPolicy
from connectors.quant import MODEL, BadStates, check_storage_dtype, logprob_problem, quantize, state_problem
from connectors.writer import BackgroundWriter

__all__ = ["HiddenStatesConnectorConfig", "SafetensorsHiddenStatesConnector"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HiddenStatesConnectorConfig:
    """`kv_connector_extra_config` of the hidden-states connector."""

    shared_storage_path: str = field(default_factory=lambda: os.path.join(tempfile.gettempdir(), "hsx"))
    """Where files go: a local folder or any fsspec URL (s3://bucket/prefix, gs://..., memory://...)."""
    allow_custom_save_path: bool = False
    """Honour per-request `hidden_states_path`. When off, a custom path is ignored with a warning (as vLLM)."""
    allowed_roots: tuple[str, ...] | None = None
    """Roots under which custom paths may land; default: shared_storage_path alone."""
    num_writer_threads: int = 8
    """Threads writing files in the background."""
    max_bytes_in_flight: int = 2 << 30
    """Bound on the memory held by writes not yet durable; a faster producer blocks. A buffer counts whole and once:
    the rows of one batch share their batch's tensor, which stays alive until the last of them is written."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to fsspec: endpoint_url, credentials, ... (e.g. {"client_kwargs": {"endpoint_url": ...}})."""
    use_synchronization_lock: bool = True
    """Hold `<file>.lock` while writing so readers wait for complete files (vLLM's key)."""
    max_write_attempts: int = 5
    """Attempts per file on transient storage errors, with exponential backoff."""
    write_retry_backoff_s: float = 0.2
    """First backoff between write attempts, in seconds; doubles per attempt (plus as much jitter), capped at 10 s."""
    storage_dtype: str = ""
    """How hidden_states are stored (connectors.quant.STORAGE_DTYPES): "" or "model" = the model dtype, bfloat16,
    float16, float32, or float8_e4m3fn ("fp8") with a float32 scale per token and layer. Recorded in every file."""
    check_states: bool = True
    """Refuse to commit states holding NaN/Inf or a layer of zeros (the request fails with BadStates, naming the token
    and layer); the check reads each sample's states once, on the writer thread."""

    def __post_init__(self) -> None:
        for name, kind in (("allow_custom_save_path", bool), ("use_synchronization_lock", bool), ("check_states", bool),
                           ("num_writer_threads", int), ("max_bytes_in_flight", int), ("max_write_attempts", int),
                           ("write_retry_backoff_s", (int, float)), ("storage_options", dict)):
            value = getattr(self, name)
            # a YAML/JSON "false" is a non-empty string, hence truthy: refuse it rather than enable custom paths
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                expected = kind.__name__ if isinstance(kind, type) else "a number"
                raise TypeError(f"kv_connector_extra_config[{name!r}] must be {expected}, got "
                                f"{type(value).__name__} {value!r}")
        if not str(self.shared_storage_path):
            raise ValueError("shared_storage_path is empty; pass a local folder or URL such as s3://bucket/run")
        if self.num_writer_threads < 1:
            raise ValueError(f"num_writer_threads must be >= 1, got {self.num_writer_threads}")
        if self.max_bytes_in_flight < 1:
            raise ValueError(f"max_bytes_in_flight must be >= 1 byte, got {self.max_bytes_in_flight}")
        if self.max_write_attempts < 1:
            raise ValueError(f"max_write_attempts must be >= 1, got {self.max_write_attempts}")
        if self.write_retry_backoff_s < 0:
            raise ValueError(f"write_retry_backoff_s must be >= 0, got {self.write_retry_backoff_s}")
        if isinstance(self.allowed_roots, str):
            object.__setattr__(self, "allowed_roots", (self.allowed_roots,))
        object.__setattr__(self, "storage_dtype", check_storage_dtype(self.storage_dtype, flag="storage_dtype"))

    @classmethod
    def from_mapping(cls, extra: Mapping[str, Any]) -> HiddenStatesConnectorConfig:
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(extra) - set(valid))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; valid keys: {valid}")
        kwargs = dict(extra)
        if kwargs.get("allowed_roots") is not None and not isinstance(kwargs["allowed_roots"], str):
            kwargs["allowed_roots"] = tuple(str(r) for r in kwargs["allowed_roots"])
        return cls(**kwargs)


@dataclass
class _Pending:
    info: RequestInfo
    dest: Destination
    """The file and the allowed root it lies in (the write walks from there again, following no symlink)."""
    include_output_tokens: bool
    remember: bool
    """Record the file as this request's once durable: a custom path without overwrite=True (see PathOwners)."""
    token_chunks: list[torch.Tensor] = field(default_factory=list)
    state_chunks: list[torch.Tensor] = field(default_factory=list)
    extra_chunks: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """The further per-token tensors of the spec's files (a top-k target's), chunk by chunk."""


def _buffers(tensors) -> dict[tuple, int]:
    """The memory a write keeps alive: every distinct buffer its tensors view, whole. A request's rows are views of
    its batch's tensor (no copy on the engine's thread), and that tensor stays alive, padding and the other rows
    included, until the last write viewing it is done."""
    out: dict[tuple, int] = {}
    for t in tensors:
        buf = t.untyped_storage()
        out[(t.device.type, t.device.index, buf.data_ptr())] = buf.nbytes()
    return out


class SafetensorsHiddenStatesConnector(HiddenStatesConnector):
    extra_config_class = HiddenStatesConnectorConfig

    def __init__(self, extra_config: HiddenStatesConnectorConfig, spec: HiddenStatesSpec) -> None:
        if extra_config.storage_dtype != MODEL:  # the files' spec records how they store the states
            spec = dataclasses.replace(spec, storage_dtype=extra_config.storage_dtype)
        super().__init__(extra_config, spec)
        cfg = extra_config
        self._fs, self._root = storage.open_url(cfg.shared_storage_path, cfg.storage_options)
        self._paths = PathPolicy(cfg.shared_storage_path, list(cfg.allowed_roots) if cfg.allowed_roots else None)
        self._writer = BackgroundWriter(cfg.num_writer_threads, cfg.max_bytes_in_flight)
        self._requests: dict[str, _Pending] = {}
        self._owners = PathOwners()
        self._futures: dict[str, Future] = {}
        self._write_secs: dict[str, float] = {}
        self._lock = threading.Lock()
        self._spec_metadata = spec.to_metadata()
        self._dtype = spec.torch_dtype
        self._extra_rows = extra_row_entries(spec)  # name -> (dtype, row shape): a top-k target's tensors

    @property
    def peak_bytes_in_flight(self) -> int:
        return self._writer.peak_bytes_in_flight

    # -- engine, per request ------------------------------------------------------------------------------------
    def start_request(self, request: RequestInfo) -> None:
        params = dict(request.kv_transfer_params or {})
        custom = params.get("hidden_states_path")
        if custom is not None and not self.extra_config.allow_custom_save_path:
            logger.warning("request %s asked for hidden_states_path=%r but allow_custom_save_path is off; "
                           "writing to the default path instead", request.request_id, custom)
            custom = None
        overwrite = params.get("overwrite", False)
        if not isinstance(overwrite, bool):
            raise ValueError(f"request {request.request_id}: kv_transfer_params['overwrite'] must be true or false, "
                             f"got {type(overwrite).__name__} {overwrite!r}")
        dest = self._paths.locate(custom) if custom is not None else self._paths.default_destination(request.request_id)
        if request.loss_mask is not None and request.loss_mask.shape != (request.num_prompt_tokens,):
            raise ValueError(f"request {request.request_id}: loss_mask has shape {list(request.loss_mask.shape)}, "
                             f"expected [{request.num_prompt_tokens}] (one value per prompt token)")
        with self._lock:
            if request.request_id in self._requests:
                raise ValueError(f"request id {request.request_id!r} is already in flight; request ids must be unique")
            self._owners.claim(dest, request.request_id, overwrite)
            self._requests[request.request_id] = _Pending(request, dest, bool(params.get("include_output_tokens")),
                                                          remember=custom is not None and not overwrite)

    def _pending(self, request_id: str) -> _Pending:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not in flight: call start_request first (a request whose "
                           "start_request raised, or that already finished, takes no rows)") from None

    def save_hidden_states(self, request_id: str, token_ids: torch.Tensor, hidden_states: torch.Tensor,
                           extra: Mapping[str, torch.Tensor] | None = None) -> None:
        pending = self._pending(request_id)
        num_layers, hidden_size = len(self.spec.layer_ids), self.spec.hidden_size
        if (hidden_states.dim() != 3 or hidden_states.shape[0] != token_ids.reshape(-1).shape[0]
                or tuple(hidden_states.shape[1:]) != (num_layers, hidden_size)):
            raise ValueError(f"request {request_id}: expected token_ids [t] and hidden_states [t, {num_layers}, "
                             f"{hidden_size}] (L from the spec's layer_ids, H = hidden_size), got "
                             f"{list(token_ids.shape)} and {list(hidden_states.shape)}")
        if hidden_states.dtype != self._dtype:
            raise ValueError(f"request {request_id}: hidden_states are {hidden_states.dtype}, but the spec (and so "
                             f"every file's metadata) says {self.spec.dtype}; capture in the spec's dtype")
        extra = dict(extra or {})
        if set(extra) != set(self._extra_rows):
            raise ValueError(f"request {request_id}: got extra rows {sorted(extra)}, but the spec's files carry "
                             f"{sorted(self._extra_rows) or 'none'} (target {self.spec.target or 'states'!r})")
        for name, (dtype, row) in self._extra_rows.items():
            got = extra[name]
            if got.dtype != dtype or tuple(got.shape) != (hidden_states.shape[0], *row):
                raise ValueError(f"request {request_id}: {name} is {got.dtype} {list(got.shape)}, expected {dtype} "
                                 f"{[hidden_states.shape[0], *row]} (one row per token)")
        pending.token_chunks.append(token_ids.reshape(-1).to(torch.int64))
        pending.state_chunks.append(hidden_states)
        for name in self._extra_rows:
            pending.extra_chunks.setdefault(name, []).append(extra[name])

    def request_finished(self, request_id: str) -> dict[str, Any]:
        with self._lock:
            pending = self._pending(request_id)
            del self._requests[request_id]
        # the chunks go to storage as they are, back to back: no concatenated copy on the engine's thread
        token_chunks = pending.token_chunks or [torch.empty(0, dtype=torch.int64)]
        state_chunks = pending.state_chunks or [
            torch.empty(0, len(self.spec.layer_ids), self.spec.hidden_size, dtype=self._dtype)]
        num_tokens = sum(c.shape[0] for c in token_chunks)
        tensors: dict[str, list[torch.Tensor]] = {TOKEN_IDS: token_chunks, HIDDEN_STATES: state_chunks}
        for name, (dtype, row) in self._extra_rows.items():
            tensors[name] = pending.extra_chunks.get(name) or [torch.empty(0, *row, dtype=dtype)]
        info = pending.info
        if info.loss_mask is not None:
            extra = max(0, num_tokens - info.num_prompt_tokens)
            mask = torch.cat([info.loss_mask.reshape(-1).to(torch.uint8), torch.ones(extra, dtype=torch.uint8)])
            tensors[LOSS_MASK] = [mask[:num_tokens]]
        metadata = request_metadata(self._spec_metadata, request_id=request_id, num_tokens=num_tokens,
                                    num_prompt_tokens=info.num_prompt_tokens,
                                    include_output_tokens=pending.include_output_tokens, sample_id=info.sample_id)
        buffers = _buffers(c for chunks in tensors.values() for c in chunks)
        try:
            future = self._writer.submit(buffers, self._write, pending, tensors, metadata, time.perf_counter())
        except BaseException:
            self._release(pending, written=False)
            raise
        with self._lock:
            self._futures[request_id] = future
        return {"hidden_states_path": pending.dest.path}

    def _write(self, pending: _Pending, tensors: dict[str, list[torch.Tensor]], metadata: dict[str, str],
               submitted: float) -> int:
        """On a writer thread. The file stops being live before the future completes: once `wait_for_save` returns,
        a later request for it sees it committed (or free), never still in flight."""
        written = False
        try:
            tensors = self._stored(pending.info.request_id, tensors)
            size = self._write_file(pending.dest, tensors, metadata)
            written = True
            with self._lock:
                self._write_secs[pending.info.request_id] = time.perf_counter() - submitted
            return size
        finally:
            self._release(pending, written=written)

    def _stored(self, request_id: str, tensors: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """The tensors as the file stores them, on the writer thread: states that must not be committed (NaN, Inf, an
        all-zero layer) refused with BadStates; states quantized to the spec's storage dtype chunk by chunk (fp8: a
        float32 scale per token and layer beside them), so a chunk's copy lives only while it is converted."""
        states = tensors[HIDDEN_STATES]
        if self.extra_config.check_states:
            problem = state_problem(states, self.spec.layer_ids, tensors[TOKEN_IDS])
            if problem is None and TARGET_TOPK_LOGPROBS in tensors:
                problem = logprob_problem(tensors[TARGET_TOPK_LOGPROBS])
            if problem is not None:
                raise BadStates(f"request {request_id}: {problem}; nothing was written. The model produced these "
                                "states: check the model and --dtype (fp16 overflows?) before re-extracting")
        if not self.spec.storage_dtype:
            return tensors
        pairs = [quantize(c, self.spec.storage_dtype) for c in states]
        out = {TOKEN_IDS: tensors[TOKEN_IDS], HIDDEN_STATES: [q for q, _ in pairs]}
        if self.spec.scaled:
            out[HIDDEN_STATES_SCALES] = [scale for _, scale in pairs]
        out.update({k: v for k, v in tensors.items() if k not in out})  # file order: the top-k target, loss_mask
        return out

    def _write_file(self, dest: Destination, tensors: dict[str, list[torch.Tensor]], metadata: dict[str, str]) -> int:
        local = storage.is_local(self._fs)
        path = dest.path if local else self._fs._strip_protocol(dest.path)
        cfg = self.extra_config
        retry = {"max_attempts": cfg.max_write_attempts, "backoff_s": cfg.write_retry_backoff_s}
        with storage.pending_write(self._fs, path, enabled=cfg.use_synchronization_lock, root=dest.root, **retry):
            return safetensors_file.write_atomic(self._fs, path, tensors, metadata, root=dest.root, **retry)

    def _release(self, pending: _Pending, *, written: bool) -> None:
        with self._lock:
            self._owners.release(pending.dest, pending.info.request_id, committed=written and pending.remember)

    def write_seconds(self, request_id: str) -> float | None:
        """Seconds request_id's file took from request_finished to durable (once; None if it was not written)."""
        with self._lock:
            return self._write_secs.pop(request_id, None)

    def forget(self, path: str) -> None:
        """A file this connector wrote has been removed (e.g. cleanup_hidden_states of an unwanted result): a later
        request may write that path again without overwrite=True."""
        with self._lock:
            self._owners.forget(path)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            pending = self._requests.pop(request_id, None)
            if pending is not None:
                self._owners.release(pending.dest, request_id, committed=False)

    # -- engine, per batch / lifetime ---------------------------------------------------------------------------
    def wait_for_save(self, timeout: float | None = None) -> dict[str, BaseException]:
        self._writer.drain(timeout)
        failures: dict[str, BaseException] = {}
        with self._lock:
            done = {rid: f for rid, f in self._futures.items() if f.done()}
            for rid, future in done.items():
                del self._futures[rid]
                if future.exception() is not None:
                    failures[rid] = future.exception()
        for rid, err in failures.items():
            logger.error("hidden states of request %s were not saved: %s", rid, err)
        return failures

    def shutdown(self) -> None:
        self._writer.drain()
        self._writer.shutdown()
