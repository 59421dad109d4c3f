"""`JobConfig`: one extraction job, typed and validated. The `hsx` CLI and job files (`--config job.yaml`) map onto
it one to one: field `max_model_len` is flag `--max-model-len` and key `max_model_len`, with the field's docstring
as its help text.

    JobConfig(...)                     validated in __post_init__; errors name the flag to change
    load_config_file(path) -> dict     a YAML or JSON job file, keys checked against the fields
    field_docs(JobConfig) -> {name: doc}
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import textwrap
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
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

    def __post_init__(self) -> None:
        if isinstance(self.corpus, str):
            object.__setattr__(self, "corpus", (self.corpus,))
        object.__setattr__(self, "corpus", tuple(str(c) for c in self.corpus))
        if self.layers is not None:
            object.__setattr__(self, "layers", _parse_layers(self.layers))
        for name in ("storage_options", "corpus_storage_options"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = _parse_json_object(value, name)
            if not isinstance(value, dict):
                raise ValueError(f"{flag(name)} must be a JSON object, got {type(value).__name__}")
            object.__setattr__(self, name, value)
        dtype = str(self.dtype).removeprefix("torch.")
        dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}.get(dtype, dtype)
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not supported; use one of {', '.join(DTYPES)}")
        object.__setattr__(self, "dtype", dtype)
        if self.overlength not in OVERLENGTH_POLICIES:
            raise ValueError(f"--overlength {self.overlength!r} is not a policy; use truncate or skip")
        for name in ("workers", "tokenizer_workers", "tokens_per_task", "manifest_flush_rows"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ValueError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")
        if self.cpus_per_worker is not None and self.cpus_per_worker < 0:
            raise ValueError(f"--cpus-per-worker must be >= 0, got {self.cpus_per_worker}")
        if self.manifest_flush_seconds <= 0:
            raise ValueError(f"--manifest-flush-seconds must be > 0, got {self.manifest_flush_seconds}")
        if self.max_tokens < 0:
            raise ValueError(f"--max-tokens must be >= 0 (0 = prompt only), got {self.max_tokens}")
        if self.include_output_tokens and self.max_tokens == 0:
            raise ValueError("--include-output-tokens needs generated tokens; pass --max-tokens K (K > 0) as well")
        if self.max_model_len is not None and self.max_tokens >= self.max_model_len:
            raise ValueError(f"--max-tokens {self.max_tokens} leaves no room for a prompt within --max-model-len "
                             f"{self.max_model_len}; lower --max-tokens or raise --max-model-len")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not self.id_field:
            raise ValueError("--id-field is empty; name the record field holding sample ids (default: id)")

    def check_required(self, names: tuple[str, ...] = ("model", "corpus", "output")) -> None:
        """Raise ValueError naming the first missing required setting (flag or job-file key)."""
        for name in names:
            if not getattr(self, name):
                raise ValueError(f"{flag(name)} is required (or key {name!r} in the --config file)")

    def replace(self, **changes: Any) -> JobConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values, keyed by field name (the job-file format)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


def _parse_layers(value: Any) -> tuple[int, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        ids = tuple(int(str(i).strip()) for i in items if str(i).strip() != "")
    except ValueError as e:
        raise ValueError(f"--layers {value!r} must be comma-separated integers, e.g. 2,16,29,32") from e
    if not ids:
        raise ValueError("--layers is empty; pass hidden-state ids such as 2,16,29,32 or leave it out for the default")
    if len(set(ids)) != len(ids):
        raise ValueError(f"--layers {list(ids)} has duplicates; list each id once")
    if any(i < 0 for i in ids):
        raise ValueError(f"--layers {list(ids)} has negative ids; ids run from 0 (embeddings) to N (last layer)")
    return ids


def _parse_json_object(text: str, name: str) -> dict:
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag(name)} is not valid JSON ({e}); pass an object such as "
                         '\'{"client_kwargs": {"endpoint_url": "http://..."}}\'') from e
    if not isinstance(value, dict):
        raise ValueError(f"{flag(name)} must be a JSON object, got {type(value).__name__}")
    return value


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (read from its source), as one line each."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML or JSON job file into {field: value}; unknown keys raise ValueError listing the valid ones."""
    import fsspec
    import yaml

    try:
        with fsspec.open(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as e:
        raise ValueError(f"--config {path!r}: no such file") from e
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path!r} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of settings, got {type(data).__name__}")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    valid = [f.name for f in dataclasses.fields(JobConfig)]
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ValueError(f"--config {path!r} has unknown keys {unknown}; valid keys: {', '.join(valid)}")
    return data
