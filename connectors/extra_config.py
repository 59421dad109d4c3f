"""`HiddenStatesConnectorConfig`: the `kv_connector_extra_config` of hsx's connector (and of its vLLM plug-in), typed and
checked. Imports no torch: a job's or a server's settings are checked before any engine loads.

    HiddenStatesConnectorConfig(...) / .from_mapping(extra)   every key, its default and its check
    FILES_POLICIES                                            which requests write a file
    write_retry(cfg)                                          the storage retry settings connectors.storage takes
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from connectors.format import MODEL, check_storage_dtype

FILES_POLICIES = ("all", "requested")
"""HiddenStatesConnectorConfig.files: every request writes a file, or only those that send kv_transfer_params."""

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
    keep_lock_file: bool = False
    """Leave `<file>.lock` (unlocked) beside each file written to a local disk, as vLLM's connector does: vLLM's own
    `load_hidden_states` opens it and fails without it. `cleanup_hidden_states` removes it with the file. The vLLM
    plug-in (vllm_engine.connector) turns it on unless told otherwise; no effect on object stores."""
    max_write_attempts: int = 5
    """Attempts per file on transient storage errors, with exponential backoff."""
    write_retry_backoff_s: float = 0.2
    """First backoff between write attempts, in seconds; doubles per attempt (plus as much jitter), capped at 10 s."""
    write_retry_s: float | None = None
    """Retry a failing write for this many seconds instead of max_write_attempts times: an outage of the store up to
    that long costs time, not samples (hsx run sets it from --storage-retry-seconds)."""
    storage_dtype: str = MODEL
    """How hidden_states are stored (connectors.format.STORAGE_DTYPES): "model" = the model dtype, bfloat16,
    float16, float32, or float8_e4m3fn ("fp8") with a float32 scale per token and layer. Recorded in every file."""
    check_states: bool = True
    """Refuse to commit states holding NaN/Inf or a layer of zeros (the request fails with BadStates, naming the token
    and layer); the check reads each sample's states once, on the writer thread."""
    max_staged_bytes_per_request: int = 256 << 20
    """Bound on the captured rows one request holds in memory (a sample far longer than max_num_batched_tokens comes
    in many prefill chunks). Once a request holds half of it, its rows go to the writer threads as a piece: checked,
    converted to the storage dtype and appended to the request's spool (spool_dir), one piece of a request at a time
    (the engine waits for the previous one before handing over the next); the file is assembled from the spool
    when the request finishes, the same bytes the in-memory path writes. A request holds at most this bound, or half
    of it plus one chunk's rows when a chunk is larger than half. Requests under half of it stay in memory."""
    files: str = "all"
    """Which requests write a file: "all" (every request of an extraction engine), or "requested" (only those whose
    SamplingParams carry kv_transfer_params, {} included; the others only generate, nothing captured or written:
    what `hsx serve --no-files` runs)."""
    mm_embeds: bool = False
    """Also store an image prompt's merged input embeddings at its image tokens (`mm_embeds` [N, H]): what vLLM's
    EAGLE proposer feeds the drafter there. Off: they are recomputable from the target's vision tower."""
    spool_dir: str = ""
    """Where long requests' spool files go: "" = beside the files on local storage (the request's allowed root), the
    system temp folder for object stores. The files are anonymous (nothing is left behind, even after a crash) and
    need room for the longest sample's stored states; on a tmpfs they are memory again."""
    max_remembered_paths: int = 16384
    """The vLLM plug-in's bound on the custom paths written without overwrite=True that its scheduler keeps refusing
    to a later writer (connectors.paths.PathOwners' max_remembered): past it the oldest is forgotten (then treated as
    a file that existed before), so a long-lived `vllm serve` stays bounded. hsx's engine remembers every one for the
    life of its LLM."""

    def __post_init__(self) -> None:
        for name, kind in (("allow_custom_save_path", bool), ("use_synchronization_lock", bool),
                           ("keep_lock_file", bool), ("check_states", bool), ("num_writer_threads", int),
                           ("max_bytes_in_flight", int), ("max_write_attempts", int),
                           ("write_retry_backoff_s", (int, float)), ("storage_options", dict),
                           ("max_staged_bytes_per_request", int), ("spool_dir", str), ("mm_embeds", bool),
                           ("max_remembered_paths", int)):
            value = getattr(self, name)
            # a YAML/JSON "false" is a non-empty string, hence truthy: refuse it rather than enable custom paths
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                expected = kind.__name__ if isinstance(kind, type) else "a number"
                raise TypeError(f"kv_connector_extra_config[{name!r}] must be {expected}, got "
                                f"{type(value).__name__} {value!r}")
        if self.files not in FILES_POLICIES:
            raise ValueError(f"files must be one of {', '.join(FILES_POLICIES)}, got {self.files!r}")
        if not str(self.shared_storage_path):
            raise ValueError("shared_storage_path is empty; pass a local folder or URL such as s3://bucket/run")
        if self.num_writer_threads < 1:
            raise ValueError(f"num_writer_threads must be >= 1, got {self.num_writer_threads}")
        if self.max_bytes_in_flight < 1:
            raise ValueError(f"max_bytes_in_flight must be >= 1 byte, got {self.max_bytes_in_flight}")
        if self.max_staged_bytes_per_request < 2:
            raise ValueError(f"max_staged_bytes_per_request must be >= 2 bytes, got {self.max_staged_bytes_per_request}"
                             " (e.g. 268435456 for 256 MiB)")
        if self.max_remembered_paths < 1:
            raise ValueError(f"kv_connector_extra_config['max_remembered_paths'] must be a positive number of paths, "
                             f"got {self.max_remembered_paths} (default 16384)")
        if self.max_write_attempts < 1:
            raise ValueError(f"max_write_attempts must be >= 1, got {self.max_write_attempts}")
        if self.write_retry_backoff_s < 0:
            raise ValueError(f"write_retry_backoff_s must be >= 0, got {self.write_retry_backoff_s}")
        if self.write_retry_s is not None and (isinstance(self.write_retry_s, bool) or
                                               not isinstance(self.write_retry_s, (int, float)) or
                                               not self.write_retry_s > 0):
            raise ValueError(f"write_retry_s must be a number of seconds > 0 (or null: max_write_attempts), got "
                             f"{self.write_retry_s!r}")
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


def write_retry(cfg: HiddenStatesConnectorConfig) -> dict:
    """The storage retry settings of a connector config, as connectors.storage's writers take them."""
    return {"max_attempts": cfg.max_write_attempts, "backoff_s": cfg.write_retry_backoff_s, "for_s": cfg.write_retry_s}
