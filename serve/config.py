"""`ServeConfig`: one `hsx serve` service, typed and validated. The CLI maps onto it one to one (field
`max_queued_requests` = flag `--max-queued-requests`, help = the field's docstring).

    ServeConfig(...)          checked in __post_init__; errors name the flag to change
    config.engine_config()    the engine's own typed settings (extractor.EngineConfig) every replica builds
    config.kv_transfer_config()
                              the connector's settings: files under --output, custom paths under --allowed-roots
    config.speculative        the SpeculativeConfig of --speculative-config (a decoding service), or None
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from typing import Any

from connectors import KVTransferConfig
from connectors.paths import PathPolicy
from connectors.storage import parse_storage_options
from extractor.config import SPECULATIVE_METHOD, speculative_config_from_dict
from extractor.options import EngineOptions, flag

API_KEY_ENV = "HSX_API_KEY"


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_PREFIX = re.compile(r"/|(/[A-Za-z0-9_.-]+)+")


@dataclass(frozen=True)
class ServeConfig(EngineOptions):
    """An OpenAI-compatible extraction service: which model, where files go, how it is guarded and scaled. The model,
    engine and output settings are `extractor.options.EngineOptions` (shared with `hsx run`)."""

    # -- what to serve (and model, layers, dtype, ...: EngineOptions) ---------------------------------------------
    output: str = ""
    """Where files go: a local folder or fsspec URL (s3://bucket/prefix); default names are <request id>.safetensors."""
    files: bool = True
    """Every request writes its file (default). --no-files: only requests that send kv_transfer_params ({} included)
    do; the others only generate, with nothing captured or written and kv_transfer_params null in the response (hsx
    serve as the generator behind `hsx regenerate`). --no-files without --output: no request writes one
    (kv_transfer_params then get 400)."""
    speculative_config: dict[str, Any] | None = None
    """vLLM's --speculative-config, as JSON: {"method": "mtp", "num_speculative_tokens": 3} (or ngram, draft_model,
    a trained drafter: {"model": DIR, ...}) makes a decoding service that drafts and verifies as vLLM does and writes
    no files (extraction is its own method, {"method": "extract_hidden_states", ...} = --layers, as in vLLM); /metrics
    then shows vLLM's vllm:spec_decode_* counters. Such a server takes no --output and refuses kv_transfer_params."""
    served_model_name: str | None = None
    """The name clients pass as `model`; default the --model value. Requests naming another model get 404."""
    max_num_seqs: int = 32
    """Prompts per gathered batch (Ray Serve's max_batch_size) and the engine's rows per forward; a replica works on
    up to twice as many at once (one engine call running, the next gathering), more wait in the queue."""
    batch_wait_timeout_s: float = 0.01
    """How long a replica waits for more requests before running a batch that is not full."""
    device: str | None = None
    """Torch device of each replica's engine (cuda, cpu); default cuda when the replica has a GPU."""
    allowed_roots: tuple[str, ...] | None = None
    """Roots under which a request's kv_transfer_params.hidden_states_path may land (comma-separated); default
    --output alone. Paths elsewhere get 403 and nothing is written."""

    # -- HTTP and protection -------------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0 for every interface; then set --api-key)."""
    port: int = 8000
    """TCP port to listen on."""
    api_key: str | None = field(default_factory=lambda: os.environ.get(API_KEY_ENV))
    """Require `Authorization: Bearer KEY` on every endpoint but /health (default $HSX_API_KEY; unset = open; an
    empty key, given either way, is refused)."""
    max_queued_requests: int = 256
    """Prompts waiting for a replica beyond those it is working on; more get 503 with Retry-After."""
    retry_after_s: int = 1
    """Retry-After seconds sent with 503 (queue full, shutting down, replica lost)."""
    max_body_bytes: int = 8 << 20
    """Largest request body in bytes; larger bodies get 400."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens; longer prompts get 400. Default max_model_len."""
    max_prompts_per_request: int = 256
    """Most prompts in one /v1/completions request (a list prompt)."""
    trust_request_chat_template: bool = False
    """Render a chat_template a /v1/chat/completions request sends (a Jinja program from the client); without this
    flag such requests get 400 and only the model's own template is used (vLLM's rule)."""
    chat_template_timeout_s: float = 1.0
    """With --trust-request-chat-template: the longest a request's template may take to render (and its output is
    bounded by --max-body-bytes); slower or larger ones get 400."""

    # -- Ray -----------------------------------------------------------------------------------------------------
    replicas: int = 1
    """Engine replicas; each holds one model and writes its own files."""
    gpus_per_replica: float | None = None
    """GPUs per replica (fractions allowed); default 1 when the cluster has GPUs, else 0."""
    cpus_per_replica: float = 1.0
    """Ray CPUs reserved per replica."""
    address: str | None = None
    """Ray cluster to run on (auto, HOST:6379, ray://HOST:10001); default a private local Ray started here."""
    name: str = "hsx"
    """The Ray Serve application's name. Two hsx serve on one cluster need different names and route prefixes."""
    route_prefix: str = "/"
    """Where the routes live on the HTTP address: /v1/completions under "/", /PREFIX/v1/completions under /PREFIX
    (clients then use base_url http://HOST:PORT/PREFIX/v1)."""
    drain_timeout_s: float = 60.0
    """On SIGTERM, how long to wait for requests in flight (and their writes) before exiting anyway."""

    def __post_init__(self) -> None:
        self._take_speculative_config()
        super().__post_init__()
        if isinstance(self.allowed_roots, str):
            object.__setattr__(self, "allowed_roots", tuple(r for r in self.allowed_roots.split(",") if r))
        if self.allowed_roots is not None:
            object.__setattr__(self, "allowed_roots", tuple(str(r) for r in self.allowed_roots))
        positive = ("port", "max_num_seqs", "max_body_bytes", "replicas", "max_prompts_per_request")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag(name)} must be a positive integer, got {value!r}")
        value = self.max_prompt_tokens
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"--max-prompt-tokens must be a positive integer, got {value!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be 1..65535, got {self.port}")
        if (not isinstance(self.max_queued_requests, int) or isinstance(self.max_queued_requests, bool)
                or self.max_queued_requests < 1):  # Ray Serve queues at least one
            raise ValueError(f"--max-queued-requests must be a positive integer (prompts waiting for an engine "
                             f"replica beyond those it runs), got {self.max_queued_requests!r}")
        if not self.chat_template_timeout_s > 0:
            raise ValueError(f"--chat-template-timeout-s must be > 0, got {self.chat_template_timeout_s}")
        for name in ("batch_wait_timeout_s", "drain_timeout_s", "cpus_per_replica", "retry_after_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.gpus_per_replica is not None and self.gpus_per_replica < 0:
            raise ValueError(f"--gpus-per-replica must be >= 0, got {self.gpus_per_replica}")
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"--name {self.name!r}: use 1-64 letters, digits, '-', '_' or '.', starting with a letter "
                             "or digit (e.g. hsx-llama)")
        if not isinstance(self.route_prefix, str) or not _PREFIX.fullmatch(self.route_prefix):
            raise ValueError(f"--route-prefix {self.route_prefix!r}: use / or /SEGMENT[/SEGMENT...] of letters, digits, "
                             "'-', '_' or '.', without a trailing / (e.g. /llama)")
        if self.api_key is not None and not self.api_key.strip():
            if os.environ.get(API_KEY_ENV) is not None and not os.environ[API_KEY_ENV].strip():
                raise ValueError(f"${API_KEY_ENV} is set but empty, which would start a server anyone can use; set "
                                 f"it to a key, or unset it (`unset {API_KEY_ENV}`) to serve without one")
            raise ValueError(f"--api-key is empty; pass a non-empty key or leave it (and ${API_KEY_ENV}) unset")
        if self.api_key is not None and self.api_key != self.api_key.strip():
            raise ValueError("--api-key begins or ends with whitespace, which clients' headers do not carry; pass the "
                             "key without it")
        if self.api_key is not None and not (self.api_key.isascii() and self.api_key.isprintable()):
            raise ValueError("--api-key holds characters outside printable ASCII, which an HTTP header cannot carry "
                             "as they are (no client could send it); use letters, digits and punctuation")
        if not isinstance(self.files, bool):  # a config file's "false" is a non-empty string
            raise ValueError(f"--files / --no-files must be true or false, got {type(self.files).__name__} "
                             f"{self.files!r}")
        if self.speculative is not None and not self.files:
            raise ValueError("--no-files with --speculative-config: a speculative server writes no files anyway; "
                             "drop --no-files")
        if not self.writes_files:
            files = [flag(n) for n in ("layers", "output", "allowed_roots", "storage_options") if getattr(self, n)]
            files += [flag(n) for n, default in (("storage_dtype", "model"), ("target", "states"))
                      if getattr(self, n) != default]
            why = (f"--speculative-config method {self.speculative.method!r}: a speculative server decodes and writes "
                   f"no files (extraction is its own method, {SPECULATIVE_METHOD}, as in vLLM); drop {', '.join(files)}"
                   ", or drop --speculative-config to serve extraction" if self.speculative is not None else
                   f"--no-files without --output: a generation-only server writes no files; drop {', '.join(files)}, "
                   "or give --output for requests that send kv_transfer_params")
            if files:
                raise ValueError(f"{', '.join(files)} with {why}")
        self.check_engine()  # the engine's and the connector's own checks, on what every replica gets

    def _take_speculative_config(self) -> None:
        """--speculative-config as a dict (JSON text from the CLI or a config file); extract_hidden_states's layer ids
        become --layers (both given: refused)."""
        value = self.speculative_config
        if value is None:
            return
        value = parse_storage_options(value, "--speculative-config",
                                      example='{"method": "mtp", "num_speculative_tokens": 3}')
        object.__setattr__(self, "speculative_config", value)
        try:
            speculative, layer_ids = speculative_config_from_dict(value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--speculative-config: {e}") from None
        self.__dict__["speculative"] = speculative  # the cached property's value: parsed (and warned about) once
        if speculative is None and layer_ids is not None:
            if self.layers is not None:
                raise ValueError(f"--layers and --speculative-config method {SPECULATIVE_METHOD} both name the "
                                 "layers to store; give one of them")
            object.__setattr__(self, "layers", layer_ids)

    @functools.cached_property
    def speculative(self):
        """The extractor.SpeculativeConfig of --speculative-config, or None (an extraction service)."""
        return speculative_config_from_dict(self.speculative_config)[0] if self.speculative_config else None

    def path_policy(self):
        """Where custom hidden_states_path values may go (connectors.paths.PathPolicy): under --allowed-roots, by
        default --output; what the ingress and every replica check alike."""
        return PathPolicy(self.output, list(self.allowed_roots) if self.allowed_roots else None)

    @property
    def writes_files(self) -> bool:
        """Whether any request may write a file (not a speculative server, not --no-files without --output)."""
        return self.speculative is None and bool(self.output or self.files)

    def check_required(self) -> None:
        if self.speculative is not None or (not self.files and not self.output):
            if not self.model:
                raise ValueError("missing --model: hsx serve needs the model to load")
            return
        missing = [flag(n) for n in ("model", "output") if not getattr(self, n)]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}: hsx serve needs the model to load and where files go "
                             "(or --speculative-config for a decoding service that writes none)")

    @property
    def base_url(self) -> str:
        """Where the routes are: http://HOST:PORT plus the route prefix (clients add /v1)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"http://{host}:{self.port}" + ("" if self.route_prefix == "/" else self.route_prefix)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_config(self, device: str | None = None, **resolved: Any):
        """The extractor.EngineConfig every replica builds its engine from (a speculative one with
        --speculative-config)."""
        if self.speculative is not None:
            resolved.setdefault("speculative", self.speculative)
        return super().engine_config(device=device or self.device, max_num_seqs=self.max_num_seqs, **resolved)

    def connector_settings(self) -> dict[str, Any]:
        """kv_connector_extra_config of the replicas' connector: custom paths under --allowed-roots."""
        return {**super().connector_settings(), "allowed_roots": list(self.allowed_roots) if self.allowed_roots else None,
                **({} if self.files else {"files": "requested"})}

    def kv_transfer_config(self):
        """The replicas' connector settings; None for a server that writes no files (speculative, or --no-files
        without --output)."""
        if self.speculative is not None:
            return None
        if not self.writes_files:
            return KVTransferConfig(kv_connector="NullConnector")
        return KVTransferConfig(kv_connector="SafetensorsHiddenStatesConnector", kv_role="kv_producer",
                                kv_connector_extra_config=self.connector_settings())
