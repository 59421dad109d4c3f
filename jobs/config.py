"""`JobConfig`: one extraction job, typed and validated. The `hsx` CLI and job files (`--config job.yaml`) map onto
it one to one: field `max_model_len` is flag `--max-model-len` and key `max_model_len`, with the field's docstring
as its help text.

    JobConfig(...)                     validated in __post_init__; errors name the flag to change. Engine and
                                       storage settings are checked by building the engine's own typed configs
                                       (engine_config, sampling_params, connector_config), the ones workers get
    EstimateConfig / SubmitConfig      `hsx estimate` / `hsx submit`: a job's settings plus their own
    StatusConfig / DemoConfig          `hsx status OUTPUT` / `hsx demo DIR`
    field_docs(JobConfig) -> {name: doc}
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Any

OVERLENGTH_POLICIES = ("truncate", "skip")


def flag(name: str) -> str:
    """The CLI flag of a config field: max_model_len -> --max-model-len."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class JobConfig:
    """An extraction job: which model, which corpus, where the files go, and how the work is spread over Ray."""

    # -- what to extract -------------------------------------------------------------------------------------------
    model: str = ""
    """Target model: a local folder (config, weights, tokenizer) or a hub id already in the local cache."""
    corpus: tuple[str, ...] = ()
    """Corpus files: JSONL (.jsonl, .json, optionally .gz) or Parquet, local paths or fsspec URLs, globs allowed."""
    output: str = ""
    """Output root, local folder or fsspec URL (s3://bucket/run): run.json, data/, manifest/ go under it."""
    layers: tuple[int, ...] | None = None
    """Hidden-state ids to store, e.g. 2,16,29,32 (0 = embeddings, k = output of decoder layer k-1, N = last layer,
    pre-norm). Default: EAGLE-3's [2, N//2, N-3, N]."""
    dtype: str = "auto"
    """Model and stored dtype: auto (the checkpoint's), float32, bfloat16 or float16."""
    revision: str | None = None
    """Model revision (branch, tag or commit) for hub ids."""
    trust_remote_code: bool = False
    """Allow custom modelling code shipped with the model."""
    attn_implementation: str | None = None
    """Attention kernel passed to transformers (sdpa, eager, flash_attention_2); default transformers' choice."""
    max_model_len: int | None = None
    """Longest sample in tokens (prompt + generated); default the model's max_position_embeddings."""
    max_num_batched_tokens: int | None = None
    """Token budget of one forward pass inside a worker; default the engine's (8192)."""

    # -- generation (optional) -------------------------------------------------------------------------------------
    max_tokens: int = 0
    """Tokens to generate after each prompt; 0 = prompt-only extraction (no sampling)."""
    temperature: float = 0.0
    """Sampling temperature when --max-tokens > 0; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling threshold when --max-tokens > 0."""
    top_k: int = 0
    """Top-k sampling when --max-tokens > 0; 0 = off."""
    seed: int | None = None
    """Sampling seed when --max-tokens > 0."""
    include_output_tokens: bool = False
    """Also store hidden states of generated tokens (needs --max-tokens > 0)."""

    # -- corpus ----------------------------------------------------------------------------------------------------
    id_field: str = "id"
    """Record field holding the sample id; records without it get a stable id from file and line/row."""
    chat_template: str | None = None
    """A Jinja chat-template file (local or URL) used instead of the tokenizer's own for chat records."""
    overlength: str = "truncate"
    """Samples longer than the limit: truncate (keep the first tokens, recorded in the manifest) or skip (a failed
    row)."""
    corpus_storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for reading the corpus, as JSON (e.g. {"client_kwargs": {"endpoint_url": ...}})."""

    # -- execution -------------------------------------------------------------------------------------------------
    workers: int = 1
    """Extraction workers; each holds one engine (one model copy) for its lifetime."""
    gpus_per_worker: float | None = None
    """GPUs per worker; default 1 when the Ray cluster has GPUs, else 0 (CPU)."""
    cpus_per_worker: float | None = None
    """Logical CPUs Ray reserves per extraction worker; a worker on CPU runs that many torch threads (at most its
    node's cores). Default: 1 for GPU workers; for CPU workers an equal share of the CPUs the readers and tokenizers
    leave (at most one node's)."""
    tokenizer_workers: int = 1
    """Tokenization actors (CPU); raise when the GPUs wait on tokenization."""
    tokens_per_task: int = 32768
    """Approximate tokens per unit of work handed to a worker; a worker that dies redoes at most its units."""
    address: str | None = None
    """Ray cluster to run on (ray://..., auto, HOST:PORT); default a local Ray started for this job (or the cluster
    in $RAY_ADDRESS)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for the output, as JSON (endpoint, credentials)."""

    # -- bookkeeping -----------------------------------------------------------------------------------------------
    fail_on_error: bool = False
    """Exit with status 1 when any sample failed (by default failures are recorded and the job succeeds)."""
    manifest_flush_rows: int = 1000
    """Commit manifest rows at least every this many samples."""
    manifest_flush_seconds: float = 30.0
    """Commit manifest rows at least this often; a crash redoes at most this much work."""
    progress: bool = True
    """Show a progress bar (samples/s, tokens/s, bytes, ETA) on stderr."""
    break_lease: bool = False
    """Take over the output's writer lease even though its holder looks alive (use only when that job is known to
    be gone; a lease whose process died, or that was not renewed for 5 minutes, is broken without this)."""

    def __post_init__(self) -> None:
        from connectors.format import check_layer_ids
        from connectors.storage import parse_storage_options
        from extractor.config import canonical_dtype

        if isinstance(self.corpus, str):
            object.__setattr__(self, "corpus", (self.corpus,))
        object.__setattr__(self, "corpus", tuple(str(c) for c in self.corpus))
        if self.layers is not None:
            object.__setattr__(self, "layers", check_layer_ids(self.layers, name="--layers"))
        for name in ("storage_options", "corpus_storage_options"):
            object.__setattr__(self, name, parse_storage_options(getattr(self, name), flag(name)))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, flag="--dtype"))
        if self.overlength not in OVERLENGTH_POLICIES:
            raise ValueError(f"--overlength {self.overlength!r} is not a policy; use truncate or skip")
        for name in ("workers", "tokenizer_workers", "tokens_per_task", "manifest_flush_rows"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ValueError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")
        if self.cpus_per_worker is not None and self.cpus_per_worker < 0:
            raise ValueError(f"--cpus-per-worker must be >= 0, got {self.cpus_per_worker}")
        if self.manifest_flush_seconds <= 0:
            raise ValueError(f"--manifest-flush-seconds must be > 0, got {self.manifest_flush_seconds}")
        if self.include_output_tokens and self.max_tokens == 0:
            raise ValueError("--include-output-tokens needs generated tokens; pass --max-tokens K (K > 0) as well")
        if self.max_model_len is not None and self.max_tokens >= self.max_model_len:
            raise ValueError(f"--max-tokens {self.max_tokens} leaves no room for a prompt within --max-model-len "
                             f"{self.max_model_len}; lower --max-tokens or raise --max-model-len")
        if not self.id_field:
            raise ValueError("--id-field is empty; name the record field holding sample ids (default: id)")
        # the engine's and the connector's own checks, on the objects the workers will get
        self.sampling_params()
        if self.model:
            self.engine_config()
        if self.output:
            self.connector_config()

    # -- the typed configs a worker's engine is built from ---------------------------------------------------------
    def engine_config(self, *, model: str | None = None, layer_ids: tuple[int, ...] | None = None,
                      dtype: str | None = None, max_model_len: int | None = None, device: str | None = None):
        """The engine's EngineConfig for this job; the keyword arguments override with values the driver resolved
        from the model's config (so every worker runs exactly what run.json records)."""
        from extractor.config import EngineConfig

        kwargs: dict[str, Any] = {}
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        return _flag_errors(EngineConfig, model=model or self.model, layer_ids=layer_ids or self.layers,
                            dtype=dtype or self.dtype, max_model_len=max_model_len or self.max_model_len,
                            device=device, attn_implementation=self.attn_implementation, revision=self.revision,
                            trust_remote_code=self.trust_remote_code, **kwargs)

    def sampling_params(self):
        """The SamplingParams every sample runs with (each gets its own kv_transfer_params on top)."""
        from extractor.sampling import SamplingParams

        return _flag_errors(SamplingParams, max_tokens=self.max_tokens, temperature=self.temperature,
                            top_p=self.top_p, top_k=self.top_k, seed=self.seed)

    def connector_config(self):
        """The hidden-states connector's settings for this job's output (custom paths: one file per sample id)."""
        from connectors.safetensors_connector import HiddenStatesConnectorConfig

        return _flag_errors(HiddenStatesConnectorConfig, shared_storage_path=self.output, allow_custom_save_path=True,
                            storage_options=dict(self.storage_options))

    def check_required(self, names: tuple[str, ...] = ("model", "corpus", "output")) -> None:
        """Raise ValueError naming the first missing required setting (flag or job-file key)."""
        for name in names:
            if not getattr(self, name):
                raise ValueError(f"{flag(name)} is required (or key {name!r} in the --config file)")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values, keyed by field name (the job-file format)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


# engine / connector argument -> the JobConfig field (flag) that sets it, where the names differ
_FLAG_OF = {"layer_ids": "layers", "eagle_aux_hidden_state_layer_ids": "layers", "shared_storage_path": "output"}


def _flag_errors(cls: type, **kwargs: Any) -> Any:
    """cls(**kwargs), with the argument names in its errors rewritten as the flags that set them."""
    import re

    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        names = {f.name for f in dataclasses.fields(JobConfig)} | set(_FLAG_OF)
        # argument names: the message's first word, and any snake_case name in it ("top_k must be ...")
        pattern = r"(?<![\w-])(" + "|".join(sorted(names, key=len, reverse=True)) + r")(?![\w-])"
        text = re.sub(r"kv_connector_extra_config\[['\"](\w+)['\"]\]", r"\1", str(e))
        text = re.sub(pattern, lambda m: flag(_FLAG_OF.get(m.group(1), m.group(1)))
                      if "_" in m.group(1) or m.start() == 0 else m.group(1), text)
        raise ValueError(text) from e


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (read from its source, its dataclass bases' too), as
    one line each."""
    docs: dict[str, str] = {}
    for base in reversed([c for c in cls.__mro__[1:] if dataclasses.is_dataclass(c)]):
        docs.update(field_docs(base))
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


# -- the other commands' settings ------------------------------------------------------------------------------
@dataclass(frozen=True)
class EstimateConfig(JobConfig):
    """`hsx estimate`: a job's settings, plus how much of the corpus to tokenize."""

    limit: int | None = None
    """Tokenize only the first N records and extrapolate (default: all of them)."""
    json: bool = False
    """Print the estimate as JSON."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")


@dataclass(frozen=True)
class SubmitConfig(JobConfig):
    """`hsx submit`: a job's settings (run as `hsx run` on the cluster), plus how to submit it. `address` is the
    cluster's dashboard here, e.g. http://HEAD:8265."""

    runtime_env: str | None = None
    """Ray runtime_env for the job, as JSON."""
    submission_id: str | None = None
    """Job id to use (default: Ray picks one)."""
    wait: bool = False
    """Stream the job's logs and exit with its status."""

    def runtime_env_dict(self) -> dict | None:
        import json

        if not self.runtime_env:
            return None
        try:
            env = json.loads(self.runtime_env)
        except json.JSONDecodeError as e:
            raise ValueError(f"--runtime-env is not valid JSON: {e}") from e
        if not isinstance(env, dict):
            raise ValueError(f"--runtime-env must be a JSON object, got {type(env).__name__}")
        return env


@dataclass(frozen=True)
class StatusConfig:
    """`hsx status OUTPUT`."""

    output: str = field(metadata={"cli": {"positional": True}})
    """The run's output folder or URL."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for OUTPUT, as JSON (e.g. '{"anon": true}')."""
    errors: int = 10
    """Failures to list."""
    json: bool = False
    """Machine-readable output."""

    def __post_init__(self) -> None:
        from connectors.storage import parse_storage_options

        object.__setattr__(self, "storage_options", parse_storage_options(self.storage_options, "--storage-options"))
        if self.errors < 0:
            raise ValueError(f"--errors must be >= 0, got {self.errors}")


@dataclass(frozen=True)
class DemoConfig:
    """`hsx demo DIR`."""

    dir: str = field(metadata={"cli": {"positional": True}})
    """Working folder (created): the tiny model, the corpus and the run go there."""
    workers: int = 1
    """Extraction workers."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        if not self.dir:
            raise ValueError("DIR is empty; pass a working folder, e.g. hsx demo ./hsx-demo")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
