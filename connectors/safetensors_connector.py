"""`SafetensorsHiddenStatesConnector`: hsx's connector, one safetensors file per request on any fsspec storage.

Writes `token_ids` [T], `hidden_states` [T, L, H] (in the spec's storage dtype: fp8 with `hidden_states_scales`
[T, L, 1], see connectors.quant), optional `loss_mask` [T], and metadata from the producer's `HiddenStatesSpec` — to a local folder or any fsspec URL, off the compute path (background writer threads, a bound on
the bytes in flight, retries, durable atomic files). Each file's metadata carries the checksum of its data
(`"checksum": "xxh3_64:<16 hex>"`), computed on the writer threads by `connectors.safetensors_file.write_atomic`; the
metadata built here holds a placeholder of the same length, so `connectors.header.file_size` predicts the file.
States holding NaN, Inf or a layer of zeros are never committed: the request fails with `connectors.quant.BadStates`
naming the token and layer (`check_states`).

Long requests in bounded memory: a request's rows stay in memory until it finishes, unless they reach half of
`max_staged_bytes_per_request` (a sample far longer than a prefill chunk); from then on they go, a piece at a time,
to a writer thread that checks them (`connectors.quant.StateChecker`, chunk by chunk), converts them to the storage
dtype and appends each per-token stream to the request's spool (`connectors.spool`), and the file is assembled from
the spool when the request finishes: the same bytes, written and uploaded streaming. The spool is released whatever
happens (a finished, failed or aborted request).

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
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors import safetensors_file, storage
from connectors.base import HiddenStatesConnector, RequestInfo
from connectors.extra_config import FILES_POLICIES, HiddenStatesConnectorConfig, write_retry  # noqa: F401 - re-exported
from connectors.format import (
    HIDDEN_STATES,
    HIDDEN_STATES_SCALES,
    LOSS_MASK,
    MM_EMBEDS,
    MODEL,
    PROMPT_ROW_FILL,
    TARGET_TOPK_LOGPROBS,
    TOKEN_IDS,
    HiddenStatesSpec,
)
from connectors.header import extra_row_entries, request_metadata
from connectors.paths import Destination, PathOwners, PathPolicy
from connectors.quant import ROW_MAGNITUDES, BadStates, StateChecker, quantize, row_magnitudes, state_problem
from connectors.spool import Spool
from connectors.writer import BackgroundWriter

__all__ = ["HiddenStatesConnectorConfig", "SafetensorsHiddenStatesConnector"]

logger = logging.getLogger(__name__)


def file_lock(fs, path: str, root: str | None, cfg: HiddenStatesConnectorConfig, *, enabled: bool = True):
    """storage.pending_write for the file at `path` (a Destination.path: local path or URL), with the connector's
    retries and lock-file policy: what its writer and the vLLM plug-in (which takes it early) both hold."""
    return storage.pending_write(fs, storage.fs_path(fs, path), enabled=enabled, root=root, keep=cfg.keep_lock_file,
                                 **write_retry(cfg))


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
    prepared: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)
    """Per chunk: (scales, magnitudes) when the engine quantized it on its device, else None."""
    extra_chunks: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """The further per-token tensors of the spec's files (a top-k target's), chunk by chunk."""
    num_tokens: int = 0
    staged_bytes: int = 0
    """Bytes of the rows held in the lists above."""
    spool: Spool | None = None
    """Set once the request passed half of max_staged_bytes_per_request: its rows go there, piece by piece."""
    checker: StateChecker | None = None
    piece: Future | None = None
    """The request's last piece on its way to the spool (one at a time: pieces append in order)."""
    piece_bytes: int = 0

    def held_bytes(self) -> int:
        """The request's rows in memory: staged, and in the piece still being spooled."""
        return self.staged_bytes + (self.piece_bytes if self.piece is not None and not self.piece.done() else 0)

    def take_rows(self) -> list[dict[str, torch.Tensor]]:
        """The staged rows chunk by chunk ({name: [t, ...]} each), handed on: nothing is staged after."""
        rows = [{TOKEN_IDS: ids, HIDDEN_STATES: states, **{n: c[i] for n, c in self.extra_chunks.items()},
                 **({} if ready is None else {HIDDEN_STATES_SCALES: ready[0], ROW_MAGNITUDES: ready[1]})}
                for i, (ids, states, ready) in enumerate(zip(self.token_chunks, self.state_chunks, self.prepared))]
        self.token_chunks, self.state_chunks, self.extra_chunks, self.prepared = [], [], {}, []
        self.staged_bytes = 0
        return rows


def _buffers(tensors) -> dict[tuple, int]:
    """The memory a write keeps alive: every distinct buffer its tensors view, whole. A request's rows are views of
    its batch's tensor (no copy on the engine's thread), and that tensor stays alive, padding and the other rows
    included, until the last write viewing it is done."""
    out: dict[tuple, int] = {}
    for t in tensors:
        buf = t.untyped_storage()
        out[(t.device.type, t.device.index, buf.data_ptr())] = buf.nbytes()
    return out


def request_destination(paths: PathPolicy, allow_custom_save_path: bool, request_id: str,
                        params: Mapping[str, Any]) -> tuple[Destination, bool]:
    """Where request `request_id`'s file goes, and whether that is its own hidden_states_path: the custom path
    located by `paths` (PathRejected when outside the allowed roots), or the default one when it asks for none or
    custom paths are off (said in a warning). The connector and the vLLM plug-in's scheduler decide alike."""
    custom = params.get("hidden_states_path")
    if custom is not None and not allow_custom_save_path:
        logger.warning("request %s asked for hidden_states_path=%r but allow_custom_save_path is off; "
                       "writing to the default path instead", request_id, custom)
        custom = None
    if custom is None:
        return paths.default_destination(request_id), False
    return paths.locate(custom), True


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
        self.peak_staged_bytes = 0
        """The most bytes of captured rows one request held in memory (staged, or in a piece being spooled)."""

    @property
    def peak_bytes_in_flight(self) -> int:
        return self._writer.peak_bytes_in_flight

    # -- engine, per request ------------------------------------------------------------------------------------
    def start_request(self, request: RequestInfo) -> None:
        params = dict(request.kv_transfer_params or {})
        overwrite = params.get("overwrite", False)
        if not isinstance(overwrite, bool):
            raise ValueError(f"request {request.request_id}: kv_transfer_params['overwrite'] must be true or false, "
                             f"got {type(overwrite).__name__} {overwrite!r}")
        dest, is_custom = request_destination(self._paths, self.extra_config.allow_custom_save_path, request.request_id,
                                              params)
        if request.loss_mask is not None and request.loss_mask.shape != (request.num_prompt_tokens,):
            raise ValueError(f"request {request.request_id}: loss_mask has shape {list(request.loss_mask.shape)}, "
                             f"expected [{request.num_prompt_tokens}] (one value per prompt token)")
        for name, rows in request.prompt_rows.items():
            if name not in PROMPT_ROW_FILL or rows.dim() < 1 or rows.shape[0] != request.num_prompt_tokens:
                raise ValueError(f"request {request.request_id}: prompt rows {name!r} of shape {list(rows.shape)}; "
                                 f"expected one of {sorted(PROMPT_ROW_FILL)} with {request.num_prompt_tokens} rows")
        with self._lock:
            if request.request_id in self._requests:
                raise ValueError(f"request id {request.request_id!r} is already in flight; request ids must be unique")
            self._owners.claim(dest, request.request_id, overwrite)
            self._requests[request.request_id] = _Pending(request, dest, bool(params.get("include_output_tokens")),
                                                          remember=is_custom and not overwrite)

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
        extra = dict(extra or {})
        prepared = self._prepared(request_id, hidden_states, extra)  # quantized on the device: its scales, magnitudes
        if hidden_states.dtype != self._dtype and prepared is None:
            raise ValueError(f"request {request_id}: hidden_states are {hidden_states.dtype}, but the spec (and so "
                             f"every file's metadata) says {self.spec.dtype}; capture in the spec's dtype")
        if set(extra) != set(self._extra_rows):
            raise ValueError(f"request {request_id}: got extra rows {sorted(extra)}, but the spec's files carry "
                             f"{sorted(self._extra_rows) or 'none'} (target {self.spec.target or 'states'!r})")
        for name, (dtype, row) in self._extra_rows.items():
            got = extra[name]
            if got.dtype != dtype or tuple(got.shape) != (hidden_states.shape[0], *row):
                raise ValueError(f"request {request_id}: {name} is {got.dtype} {list(got.shape)}, expected {dtype} "
                                 f"{[hidden_states.shape[0], *row]} (one row per token)")
        pending.num_tokens += hidden_states.shape[0]
        if pending.piece is not None and pending.piece.done() and pending.piece.exception() is not None:
            return  # a piece failed (BadStates, storage): the request fails with it; its rows need not be kept
        token_ids = token_ids.reshape(-1).to(torch.int64)
        nbytes = token_ids.nbytes + hidden_states.nbytes + sum(t.nbytes for t in [*extra.values(), *(prepared or ())])
        bound = self.extra_config.max_staged_bytes_per_request
        if pending.piece is not None and pending.held_bytes() + nbytes > bound:
            wait([pending.piece])  # the previous piece is written before more rows are taken
        pending.token_chunks.append(token_ids)
        pending.state_chunks.append(hidden_states)
        pending.prepared.append(prepared)
        for name in self._extra_rows:
            pending.extra_chunks.setdefault(name, []).append(extra[name])
        pending.staged_bytes += nbytes
        self.peak_staged_bytes = max(self.peak_staged_bytes, pending.held_bytes())
        if pending.staged_bytes >= bound // 2:
            self._spool_piece(pending)

    def _prepared(self, request_id: str, states: torch.Tensor, extra: dict[str, torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows the engine quantized on its device (fp8 states with HIDDEN_STATES_SCALES and ROW_MAGNITUDES in
        `extra`, taken out of it): (scales [t, L, 1] float32, magnitudes [t, L]); None for rows in the model dtype."""
        if HIDDEN_STATES_SCALES not in extra and ROW_MAGNITUDES not in extra:
            return None
        scales, magnitudes = extra.pop(HIDDEN_STATES_SCALES, None), extra.pop(ROW_MAGNITUDES, None)
        t, num_layers = states.shape[0], len(self.spec.layer_ids)
        if (not self.spec.scaled or states.dtype != self.spec.stored_torch_dtype or scales is None or magnitudes is None
                or scales.dtype != torch.float32 or tuple(scales.shape) != (t, num_layers, 1)
                or magnitudes.dtype != self._dtype or tuple(magnitudes.shape) != (t, num_layers)):
            raise ValueError(f"request {request_id}: rows quantized on the device must be {self.spec.storage_dtype or 'the model dtype'} "
                             f"states with {HIDDEN_STATES_SCALES} float32 [t, L, 1] and {ROW_MAGNITUDES} "
                             f"{self._dtype} [t, L], for a connector storing fp8; got states {states.dtype}, scales "
                             f"{None if scales is None else (scales.dtype, list(scales.shape))}, magnitudes "
                             f"{None if magnitudes is None else (magnitudes.dtype, list(magnitudes.shape))}")
        return scales, magnitudes

    def _spool_piece(self, pending: _Pending) -> None:
        """Hand the staged rows to a writer thread, which appends them to the request's spool (after its previous
        piece: the engine waits for that one first)."""
        if pending.spool is None:
            cfg = self.extra_config
            local = storage.is_local(self._fs)
            pending.spool = Spool(cfg.spool_dir or (pending.dest.root if local else tempfile.gettempdir()))
            pending.checker = StateChecker(self.spec.layer_ids)
            logger.debug("request %s holds %d bytes of rows: spooling to %s", pending.info.request_id,
                         pending.staged_bytes, pending.spool.directory)
        if pending.piece is not None:
            wait([pending.piece])
            if pending.piece.exception() is not None:  # the request fails with it: these rows need no spooling
                pending.take_rows()
                return
        nbytes = pending.staged_bytes
        rows = pending.take_rows()
        pending.piece = self._writer.submit(_buffers(t for r in rows for t in r.values()), self._append_piece,
                                            pending, rows)
        pending.piece_bytes = nbytes

    def _append_piece(self, pending: _Pending, rows: list[dict[str, torch.Tensor]]) -> None:
        """On a writer thread: check each chunk's rows, convert them to the storage dtype, append every stream."""
        for chunk in rows:
            states = chunk[HIDDEN_STATES]
            magnitudes = self._magnitudes(states, chunk.get(ROW_MAGNITUDES))
            if self.extra_config.check_states:
                problem = pending.checker.feed(states, chunk[TOKEN_IDS], chunk.get(TARGET_TOPK_LOGPROBS), magnitudes)
                if problem is not None:
                    raise self._bad_states(pending.info.request_id, problem)
            stored = self._stored_rows(chunk, magnitudes)
            for name, t in stored.items():
                pending.spool.append(name, t)

    def request_finished(self, request_id: str) -> dict[str, Any]:
        with self._lock:
            pending = self._pending(request_id)
            del self._requests[request_id]
        if pending.spool is not None:
            return self._finish_spooled(pending)
        # the chunks go to storage as they are, back to back: no concatenated copy on the engine's thread
        token_chunks = pending.token_chunks or [torch.empty(0, dtype=torch.int64)]
        state_chunks = pending.state_chunks or [
            torch.empty(0, len(self.spec.layer_ids), self.spec.hidden_size, dtype=self._dtype)]
        tensors: dict[str, list[torch.Tensor]] = {TOKEN_IDS: token_chunks, HIDDEN_STATES: state_chunks}
        for name, (dtype, row) in self._extra_rows.items():
            tensors[name] = pending.extra_chunks.get(name) or [torch.empty(0, *row, dtype=dtype)]
        tensors.update({name: [t] for name, t in self._request_rows(pending).items()})
        buffers = _buffers([*(c for chunks in tensors.values() for c in chunks),
                            *(t for ready in pending.prepared if ready is not None for t in ready)])
        return self._submit(pending, buffers, self._stored, tensors, pending.prepared)

    def _request_rows(self, pending: _Pending) -> dict[str, torch.Tensor]:
        """The request's own tensors over the file's T rows, in file order: its loss_mask (1 over output tokens),
        its prompt rows extended over output tokens by PROMPT_ROW_FILL, then mm_embeds when stored."""
        info = pending.info
        out: dict[str, torch.Tensor] = {}
        extra = max(0, pending.num_tokens - info.num_prompt_tokens)
        if info.loss_mask is not None:
            mask = torch.cat([info.loss_mask.reshape(-1).to(torch.uint8), torch.ones(extra, dtype=torch.uint8)])
            out[LOSS_MASK] = mask[:pending.num_tokens]
        for name, rows in info.prompt_rows.items():
            rows = rows.cpu()
            if extra:
                if PROMPT_ROW_FILL[name] == "continue":  # positions: every stream goes on from the largest + 1
                    start = int(rows.max()) + 1 if rows.numel() else 0
                    after = torch.arange(start, start + extra, dtype=rows.dtype)
                    after = after.reshape(-1, *[1] * (rows.dim() - 1)).expand(extra, *rows.shape[1:])
                else:
                    after = rows.new_zeros((extra, *rows.shape[1:]))
                rows = torch.cat([rows, after])
            out[name] = rows[:pending.num_tokens].contiguous()
        if self.extra_config.mm_embeds and MM_EMBEDS in info.request_tensors:
            out[MM_EMBEDS] = info.request_tensors[MM_EMBEDS].cpu().contiguous()
        return out

    def _submit(self, pending: _Pending, buffers: dict[tuple, int], prepare, *args) -> dict[str, Any]:
        """The request's file goes to a writer thread: `prepare(pending, *args)` there gives its tensors."""
        info = pending.info
        metadata = request_metadata(self._spec_metadata, request_id=info.request_id, num_tokens=pending.num_tokens,
                                    num_prompt_tokens=info.num_prompt_tokens,
                                    include_output_tokens=pending.include_output_tokens, sample_id=info.sample_id)
        try:
            future = self._writer.submit(buffers, self._write, pending, prepare, args, metadata, time.perf_counter())
        except BaseException:
            self._release(pending, written=False)
            self._close_spool(pending)
            raise
        with self._lock:
            self._futures[info.request_id] = future
        return {"hidden_states_path": pending.dest.path}

    def _finish_spooled(self, pending: _Pending) -> dict[str, Any]:
        """A spooled request: its last rows are spooled, then its file is assembled from the spool (writer thread)."""
        rows = pending.take_rows()
        return self._submit(pending, _buffers(t for r in rows for t in r.values()), self._spooled, rows)

    def _spooled(self, pending: _Pending, rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """On a writer thread: the file's tensors from the spool, once the previous piece (FIFO: started before this
        task) and these last rows are in it and the whole sample passed the check."""
        pending.piece.result()  # raises the piece's own error (BadStates, a full disk)
        self._append_piece(pending, rows)
        problem = pending.checker.finish() if self.extra_config.check_states else None
        if problem is not None:
            raise self._bad_states(pending.info.request_id, problem)
        spool = pending.spool
        names = [TOKEN_IDS, HIDDEN_STATES] + ([HIDDEN_STATES_SCALES] if self.spec.scaled else []) + list(
            self._extra_rows)
        tensors: dict[str, Any] = {name: spool.stream(name) for name in names}
        tensors.update(self._request_rows(pending))
        return tensors

    def _write(self, pending: _Pending, prepare, args: tuple, metadata: dict[str, str], submitted: float) -> int:
        """On a writer thread. The file stops being live before the future completes: once `wait_for_save` returns,
        a later request for it sees it committed (or free), never still in flight."""
        written = False
        try:
            tensors = prepare(pending, *args)
            size = self._write_file(pending.dest, tensors, metadata)
            written = True
            with self._lock:
                self._write_secs[pending.info.request_id] = time.perf_counter() - submitted
            return size
        finally:
            self._release(pending, written=written)
            self._close_spool(pending)

    @staticmethod
    def _bad_states(request_id: str, problem: str) -> BadStates:
        return BadStates(f"request {request_id}: {problem}; nothing was written. The model produced these states: "
                         "check the model and --dtype (fp16 overflows?) before re-extracting")

    def _stored(self, pending: _Pending, tensors: dict[str, list[torch.Tensor]],
                prepared: list[tuple[torch.Tensor, torch.Tensor] | None]) -> dict[str, list[torch.Tensor]]:
        """The tensors as the file stores them, on the writer thread: states that must not be committed (NaN, Inf, an
        all-zero layer) refused with BadStates; states quantized to the spec's storage dtype chunk by chunk (fp8: a
        float32 scale per token and layer beside them), so a chunk's copy lives only while it is converted."""
        states = tensors[HIDDEN_STATES]
        prepared = prepared if len(prepared) == len(states) else [None] * len(states)  # no rows: one empty chunk
        magnitudes = [self._magnitudes(c, None if ready is None else ready[1]) for c, ready in zip(states, prepared)]
        if self.extra_config.check_states:
            problem = state_problem(states, self.spec.layer_ids, tensors[TOKEN_IDS], tensors.get(TARGET_TOPK_LOGPROBS),
                                    magnitudes)
            if problem is not None:
                raise self._bad_states(pending.info.request_id, problem)
        if not self.spec.storage_dtype:
            return tensors
        pairs = [self._converted(c, None if ready is None else ready[0], m)
                 for c, m, ready in zip(states, magnitudes, prepared)]
        out = {TOKEN_IDS: tensors[TOKEN_IDS], HIDDEN_STATES: [q for q, _ in pairs]}
        if self.spec.scaled:
            out[HIDDEN_STATES_SCALES] = [scale for _, scale in pairs]
        out.update({k: v for k, v in tensors.items() if k not in out})  # file order: the top-k target, loss_mask
        return out

    def _magnitudes(self, states: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor | None:
        """A chunk's row magnitudes: those the engine sent (rows quantized on its device), else computed once when
        the writer reads them (the state check, fp8's scales), else None."""
        if given is not None or not (self.extra_config.check_states or self.spec.scaled):
            return given
        return row_magnitudes(states)

    def _converted(self, states: torch.Tensor, scales: torch.Tensor | None, magnitudes: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A chunk's states as the file stores them and their scales: as they came when the engine quantized them on
        its device (`scales` given), else converted here."""
        if scales is not None:
            return states, scales
        return quantize(states, self.spec.storage_dtype or MODEL, magnitudes)

    def _stored_rows(self, rows: dict[str, torch.Tensor], magnitudes: torch.Tensor | None = None
                     ) -> dict[str, torch.Tensor]:
        """One chunk's rows as the file stores them, in file order (the spool's pieces)."""
        stored, scales = self._converted(rows[HIDDEN_STATES], rows.get(HIDDEN_STATES_SCALES), magnitudes)
        out = {TOKEN_IDS: rows[TOKEN_IDS], HIDDEN_STATES: stored}
        if scales is not None:
            out[HIDDEN_STATES_SCALES] = scales
        out.update({name: rows[name] for name in self._extra_rows})
        return out

    @staticmethod
    def _close_spool(pending: _Pending) -> None:
        """Release the request's spool files (anonymous: closing removes them), after the piece that may be writing
        to them (an abort waits for at most that one piece)."""
        if pending.spool is not None:
            if pending.piece is not None:
                wait([pending.piece])
            pending.spool.close()

    def _write_file(self, dest: Destination, tensors: dict[str, list[torch.Tensor]], metadata: dict[str, str]) -> int:
        cfg = self.extra_config
        with file_lock(self._fs, dest.path, dest.root, cfg, enabled=cfg.use_synchronization_lock):
            return safetensors_file.write_atomic(self._fs, storage.fs_path(self._fs, dest.path), tensors, metadata,
                                                 root=dest.root, **write_retry(cfg))

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
        if pending is not None:
            self._close_spool(pending)

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
        with self._lock:
            unfinished = list(self._requests.values())
        for pending in unfinished:  # started, never finished nor aborted: their spools go now
            self._close_spool(pending)
        self._writer.shutdown()
