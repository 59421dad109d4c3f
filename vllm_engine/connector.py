"""hsx's connector as a vLLM KV-connector plug-in: vLLM's `extract_hidden_states` pseudo-drafter captures the layers,
hsx's writer stores them (any fsspec URL, fp8 / storage dtypes, checksums, atomic commit, the custom-path policy).

    LLM(model, speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}}},
        kv_transfer_config=KVTransferConfig(kv_connector="HsxHiddenStatesConnector",
            kv_connector_module_path="vllm_engine.connector", kv_role="kv_producer",
            kv_connector_extra_config={"shared_storage_path": "s3://bucket/run", ...}))

kv_connector_extra_config takes hsx's connector settings (connectors.safetensors_connector.HiddenStatesConnectorConfig:
shared_storage_path, allow_custom_save_path, allowed_roots, storage_options, storage_dtype, ...); per-request
kv_transfer_params as vLLM's: hidden_states_path, include_output_tokens (prompt + output minus the last token).

vLLM calls it from two processes (grouped by who calls what, in call order):

Scheduler, per step and per request:
    build_connector_meta(out)         each new request's file, located once by hsx's path policy (a custom path
                                      outside the allowed roots is refused: the request's output says so and no
                                      file is written); the finished requests' saves handed to the worker
    request_finished[_all_groups](req, blocks) -> (True, {"hidden_states_path"})   the request's tokens and the
                                      blocks of the hidden-state cache, kept until the worker has written them; an
                                      aborted or errored request writes nothing and its path is free at once
    update_connector_output(out)      the worker's done requests: their paths are free again (a custom path written
                                      without overwrite=True stays owned, up to max_remembered_paths of them; a failed
                                      write's path is free for a retry)
Worker (TP rank 0 writes; the other ranks hold no file):
    register_kv_caches(caches)        the CacheOnlyAttentionLayer's cache: [blocks, layers, block_size, hidden]
    get_finished(ids) -> (done, None) each handed-over save gathered from its slots, written by hsx's connector and
                                      made durable before the request is reported done (its blocks freed)
    build_connector_worker_meta()     the requests of this step whose file was not written, for the scheduler

Per-request state is dropped when the request settles (written, failed, refused or aborted), so a long-lived
`vllm serve` holds only its requests in flight and the remembered custom paths (kv_connector_extra_config
max_remembered_paths at most, default 16384).

The file is hsx's: `load_hidden_states` of hsx reads it (token_ids [T], hidden_states [T, L, H] and the spec's
metadata); the states are those vLLM's pseudo-drafter cached, layer ids in vLLM's convention (0 = embeddings, k = the
output of decoder layer k-1), in the order `eagle_aux_hidden_state_layer_ids` lists them (vLLM captures them in
ascending order, and its own connector stores that order whatever was asked: [2, 1, 4] gives [1, 2, 4] there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from connectors.base import RequestInfo
from connectors.format import HiddenStatesSpec
from connectors.paths import Destination, PathInUse, PathOwners, PathPolicy, PathRejected
from connectors.quant import BadStates, write_failure
from connectors.safetensors_connector import (
    HiddenStatesConnectorConfig,
    SafetensorsHiddenStatesConnector,
    file_lock,
    request_destination,
)
from connectors.storage import open_url
from extractor.facts import text_config
from vllm_engine import outcomes
from vllm_engine.rows import HostCopy

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

@dataclass
class _Save:
    """One finished request's save, from the scheduler to the worker."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    kv_transfer_params: dict[str, Any]


@dataclass
class HsxConnectorMetadata(KVConnectorMetadata):
    saves: list[_Save] = field(default_factory=list)
    new_files: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    releases: list[str] = field(default_factory=list)
    """Requests that finished without a save (aborted, errored): their locks go, nothing is written."""
    """request id -> (path, allowed root) of the requests scheduled for the first time: their locks are taken in
    this step, before their outputs can reach the client."""


@dataclass
class HsxWorkerMetadata(KVConnectorWorkerMetadata):
    """From the worker to the scheduler, once per step."""

    failed: set[str] = field(default_factory=set)
    """Requests reported done whose file was not written: their paths are free again (a retry may claim them)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return HsxWorkerMetadata(self.failed | getattr(other, "failed", set()))


def hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
    """The KV-cache group of the hidden-state cache (found by its spec, the same on both sides)."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    found = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(found) == 1:
        return found[0]
    if not found and len(groups) == 1:
        return 0
    raise ValueError(f"cannot tell the hidden-state cache among {len(groups)} KV-cache groups; the "
                     "extract_hidden_states method needs its cache in a group of its own")


def file_spec(vllm_config: VllmConfig) -> HiddenStatesSpec:
    """The spec of the files: the pseudo-drafter's layer ids, the target's sizes and dtype."""
    model = vllm_config.model_config
    text = text_config(model.hf_config)
    draft = vllm_config.speculative_config.draft_model_config.hf_config
    layer_ids = tuple(int(i) for i in getattr(draft, "eagle_aux_hidden_state_layer_ids", ()) or ())
    return HiddenStatesSpec(layer_ids=layer_ids, num_hidden_layers=int(text.num_hidden_layers),
                            hidden_size=int(text.hidden_size), dtype=str(model.dtype).removeprefix("torch."),
                            model=str(model.model), model_revision=model.revision or "",
                            extra={"engine": "vllm", "architecture": (text.architectures or [""])[0]
                                   if getattr(text, "architectures", None) else ""})


class HsxHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.speculative_config is None or vllm_config.speculative_config.method != "extract_hidden_states":
            raise ValueError("HsxHiddenStatesConnector stores the states of the extract_hidden_states method: pass "
                             'speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1, ...}')
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        extra.setdefault("keep_lock_file", True)  # vLLM's load_hidden_states opens <file>.lock
        self.settings: HiddenStatesConnectorConfig = SafetensorsHiddenStatesConnector.parse_extra_config(extra)
        if self.settings.files != "all":
            raise ValueError(f"kv_connector_extra_config files={self.settings.files!r} is hsx's engine's setting; "
                             "under vLLM every request of an extract_hidden_states engine writes its file (drop it)")
        self.spec = file_spec(vllm_config)
        # vLLM captures the layers in ascending order (sorted(set(ids)), SupportsEagle3); files keep the order asked
        captured = sorted(set(self.spec.layer_ids))
        self._order = [captured.index(i) for i in self.spec.layer_ids]
        self._group = hidden_state_group(kv_cache_config)
        self._block_size = (kv_cache_config.kv_cache_groups[self._group].kv_cache_spec.block_size
                            if kv_cache_config is not None else vllm_config.cache_config.block_size)
        # scheduler side
        self._paths = PathPolicy(self.settings.shared_storage_path,
                                 list(self.settings.allowed_roots) if self.settings.allowed_roots else None)
        self._located: dict[str, tuple[str | None, str | None]] = {}  # request id -> (path, refusal)
        self._new_files: dict[str, tuple[str, str | None]] = {}
        self._saves: list[_Save] = []
        self._releases: list[str] = []
        # who owns which file (connectors.paths.PathOwners), decided here alone, before vLLM hands a client the path;
        # the worker writes what this side accepted
        self._owners = PathOwners(max_remembered=self.settings.max_remembered_paths)
        self._claims: dict[str, tuple[Destination, bool]] = {}  # request id -> (its file, remembered once written)
        # worker side
        self._cache: torch.Tensor | None = None
        self._writes = False
        self._writer: SafetensorsHiddenStatesConnector | None = None
        self._locks: dict[str, contextlib.ExitStack] = {}  # request id -> its file's lock, held until durable
        self._lock_errors: dict[str, BaseException] = {}  # request id -> why its lock could not be taken
        self._failed: set[str] = set()  # this step's requests whose file was not written (build_connector_worker_meta)
        self._host = HostCopy()

    # -- scheduler ----------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # it stores, never loads

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        pass

    def _locate(self, request_id: str, params: dict[str, Any]) -> tuple[str | None, str | None]:
        """(the file's path, None), or (None, why it is refused): hsx's path policy and file ownership."""
        overwrite = params.get("overwrite", False)
        if not isinstance(overwrite, bool):
            return None, (f"kv_transfer_params['overwrite'] must be true or false, got {type(overwrite).__name__} "
                          f"{overwrite!r}; nothing was written")
        try:
            dest, is_custom = request_destination(self._paths, self.settings.allow_custom_save_path, request_id,
                                                  params)
            # a second writer of a running request's file would wait on its lock inside vLLM's step, forever: refused
            # even with overwrite=True (which replaces a written file, not one this engine is still writing)
            running = self._owners.writer_of(dest) if overwrite else None
            if running is not None:
                raise PathInUse(f"request {request_id!r}: {dest.path} is being written by request {running!r}, not "
                                "yet durable; overwrite=True replaces a written file, not one this engine is still "
                                "writing (its lock is held until then). Resubmit once that request has finished")
            self._owners.claim(dest, request_id, overwrite)
        except (PathRejected, PathInUse) as e:
            return None, f"{e}; nothing was written"
        self._claims[request_id] = (dest, is_custom and not overwrite)
        self._new_files[request_id] = (dest.path, dest.root)
        return dest.path, None

    def _settled(self, request_id: str, written: bool) -> None:
        """The request's file is durable (a custom path without overwrite=True stays owned, see PathOwners), or
        failed or abandoned: its path may be asked for again without overwrite=True."""
        claim = self._claims.pop(request_id, None)
        if claim is not None:
            dest, remember = claim
            self._owners.release(dest, request_id, committed=written and remember)

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        for rid in meta.failed if isinstance(meta, HsxWorkerMetadata) else ():
            self._settled(rid, written=False)  # reported done as well: settled first as not written
        for rid in connector_output.finished_sending or ():
            self._settled(rid, written=True)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._located:  # scheduled again (resumed after preemption): its file is decided
                continue
            extra = (new.sampling_params.extra_args or {}) if new.sampling_params else {}
            self._located[new.req_id] = self._locate(new.req_id, dict(extra.get("kv_transfer_params") or {}))
        meta = HsxConnectorMetadata(saves=self._saves, new_files=self._new_files, releases=self._releases)
        self._saves, self._new_files, self._releases = [], {}, []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        located = self._located.pop(request.request_id, None)
        if located is None:  # aborted before it was scheduled: nothing was captured
            return False, None
        path, refusal = located
        if refusal is not None:
            return False, {"hidden_states_path": None, "error": refusal}
        from vllm.v1.request import RequestStatus

        if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            # not every slot was computed: a file of it would hold other requests' stale rows
            self._releases.append(request.request_id)
            self._settled(request.request_id, written=False)
            return False, {"hidden_states_path": None,
                           "error": f"the request ended {request.status.name.lower()}; nothing was written"}
        params = dict(request.kv_transfer_params or {})
        prompt = list(request.prompt_token_ids or [])
        tokens = list(request.all_token_ids)[:-1] if params.get("include_output_tokens") else prompt
        self._saves.append(_Save(request.request_id, tokens, len(prompt), list(block_ids), params))
        return True, {"hidden_states_path": path}

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._group < len(block_ids):
            if self._located.pop(request.request_id, None) is not None:
                self._releases.append(request.request_id)
                self._settled(request.request_id, written=False)
            return False, None
        return self.request_finished(request, block_ids[self._group])

    # -- worker -------------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise ValueError(f"expected one CacheOnlyAttentionLayer (extract_hidden_states), found {len(layers)}")
        self._cache = kv_caches[layers[0]]  # [blocks, layers, block_size, hidden]
        if self._cache.shape[2] != self._block_size:
            raise ValueError(f"the hidden-state cache's block size is {self._cache.shape[2]}, its group says "
                             f"{self._block_size}: its slots would be read wrong")
        self._writes = get_tensor_model_parallel_rank() == 0
        if self._writes:
            # the plug-in holds each file's lock from the step its request is scheduled until the file is durable
            # (vLLM returns the path a step before the write): the writer takes none of its own
            self._writer = SafetensorsHiddenStatesConnector(
                dataclasses.replace(self.settings, use_synchronization_lock=False), self.spec)
            self._fs, _ = open_url(self.settings.shared_storage_path, self.settings.storage_options)

    def start_load_kv(self, *args, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        pass  # the pseudo-drafter has cached the states; they are read when the request finishes

    def wait_for_save(self) -> None:
        """The locks of this step's new requests' files, taken before their outputs can reach the client: a reader
        (hsx's or vLLM's load_hidden_states) that has the path waits for the file instead of missing it."""
        if not self._writes or not self.settings.use_synchronization_lock or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for rid, (path, root) in (meta.new_files if isinstance(meta, HsxConnectorMetadata) else {}).items():
            if rid in self._locks:
                continue
            stack = contextlib.ExitStack()
            try:
                stack.enter_context(file_lock(self._fs, path, root, self.settings))
            except (OSError, ValueError) as e:  # written without its lock, a reader could read it half: not at all
                self._lock_errors[rid] = e
                continue
            self._lock_errors.pop(rid, None)
            self._locks[rid] = stack

    def _unlock(self, request_id: str, written: bool) -> None:
        stack = self._locks.pop(request_id, None)
        if stack is not None:
            failed = RuntimeError("not written")
            stack.__exit__(None, None, None) if written else stack.__exit__(RuntimeError, failed, None)

    def _rows(self, save: _Save) -> torch.Tensor:
        """[T, L, H] of one request, gathered from its blocks' slots, on the CPU (vllm_engine.rows)."""
        return self._host.rows(self._cache, save.block_ids, self._block_size, len(save.token_ids), self._order)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self.has_connector_metadata():
            return None, None
        meta = self._get_connector_metadata()
        saves = meta.saves if isinstance(meta, HsxConnectorMetadata) else []
        if self._writes and isinstance(meta, HsxConnectorMetadata):
            for rid in meta.releases:
                self._lock_errors.pop(rid, None)
                self._release(rid, written=False)
        if not saves or not self._writes:
            return None, None
        done = {save.request_id for save in saves}
        failed = {rid: self._failure(rid, e) for rid, e in
                  ((save.request_id, self._lock_errors.pop(save.request_id, None) or self._hand_over(save))
                   for save in saves) if e is not None}
        failed.update({rid: self._failure(rid, e)  # durable before the blocks are freed
                       for rid, e in self._writer.wait_for_save().items() if rid not in failed})
        for save in saves:
            kind, error = failed.get(save.request_id, (None, None))
            self._release(save.request_id, written=kind is None)
            self._writer.write_seconds(save.request_id)  # read once or kept forever: nobody here asks for it
            outcomes.record(save.kv_transfer_params.get(outcomes.TICKET), kind, error)
        self._failed.update(failed)
        return done, None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        failed, self._failed = self._failed, set()
        return HsxWorkerMetadata(failed) if failed else None

    def _release(self, request_id: str, written: bool) -> None:
        """_unlock, never raising into vLLM's step (a lock that cannot be cleaned up is logged)."""
        try:
            self._unlock(request_id, written)
        except Exception as e:  # noqa: BLE001 - vLLM's step must go on; the file itself is settled
            logger.error("the lock of request %s's file could not be released: %s", request_id, e)

    def _hand_over(self, save: _Save) -> BaseException | None:
        """Give one finished request's rows to the writer; the error that stopped it, if any. The scheduler has
        decided who owns the path (`_locate`): the writer is told to write it (overwrite) and remembers nothing."""
        params = {**save.kv_transfer_params, "overwrite": True}
        try:
            mask = params.get("loss_mask")
            self._writer.start_request(RequestInfo(save.request_id, save.num_prompt_tokens, params,
                                                   sample_id=params.get("sample_id"),
                                                   loss_mask=None if mask is None else torch.tensor(mask,
                                                                                                    dtype=torch.uint8)))
        except Exception as e:  # noqa: BLE001 - a client's bad loss_mask (RuntimeError) must not stop vLLM's step
            return e
        try:
            self._writer.save_hidden_states(save.request_id, torch.tensor(save.token_ids, dtype=torch.int64),
                                            self._rows(save))
            self._writer.request_finished(save.request_id)
        except Exception as e:  # noqa: BLE001 - that request fails, the others and the engine go on
            self._writer.abort_request(save.request_id)
            return e
        return None

    @staticmethod
    def _failure(request_id: str, error: BaseException) -> tuple[str, str]:
        """(hsx's error kind, message) of a file that was not written; logged, as vLLM's own callers see nothing."""
        logger.error("hidden states of request %s were not written: %s", request_id, error)
        if isinstance(error, (ValueError, TypeError)) and not isinstance(error, (OSError, BadStates)):
            return ("path_in_use" if isinstance(error, PathInUse) else "invalid"), str(error)
        return write_failure(error)

    def get_finished_count(self) -> int:
        return 1  # rank 0 alone reports a request done

    def shutdown(self) -> None:
        for rid in list(self._locks):  # requests that never finished: their files were never written
            self._release(rid, written=False)
        if self._writer is not None:
            self._writer.shutdown()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # [.., tokens, layers, hidden]: each token's states together

