"""`JobConfig`: one extraction job, typed and validated. The `hsx` CLI and job files (`--config job.yaml`) map onto
it one to one: field `max_model_len` is flag `--max-model-len` and key `max_model_len`, with the field's docstring
as its help text.

    JobConfig(...)                     validated in __post_init__; errors name the flag to change. The model,
                                       engine and output settings are extractor.options.EngineOptions (shared with
                                       hsx serve), checked by building the engine's own typed configs
                                       (engine_config, sampling_params, connector_config), the ones workers get
    EstimateConfig / SubmitConfig      `hsx estimate` / `hsx submit`: a job's settings plus their own
    StatusConfig / DemoConfig          `hsx status OUTPUT` / `hsx demo DIR`
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from connectors.storage import parse_storage_options
from extractor.engines import DEFAULT, EngineFlags, EngineKind, engine_kind
from extractor.options import EngineOptions, flag, flag_errors
from regeneration.config import RegenerateConfig

OVERLENGTH_POLICIES = ("truncate", "skip")
LAYOUTS = ("files", "sharded")
NONFINITE_POLICIES = ("fail", "skip")


@dataclass(frozen=True)
class JobConfig(EngineOptions):
    """An extraction job: which model, which corpus, where the files go, and how the work is spread over Ray. The
    model, engine and output settings are `extractor.options.EngineOptions` (shared with `hsx serve`)."""

    # -- what to extract -------------------------------------------------------------------------------------------
    corpus: tuple[str, ...] = ()
    """Corpus files: JSONL (.jsonl, .json, optionally .gz) or Parquet, local paths or fsspec URLs, globs allowed."""

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
    regenerate_with: tuple[str, ...] = field(default=(), metadata={"cli": {"append": True, "metavar": "URL"}})
    """Regenerate the corpus's answers through this OpenAI-compatible server first (vLLM, SGLang, hsx serve; repeat
    for several) and extract the regenerated corpus prefill-only, streaming: extraction starts with the first
    committed records. Re-running the same command resumes both."""
    regenerate: dict[str, Any] = field(default_factory=dict)
    """--regenerate-with's settings as JSON, hsx regenerate's keys: max_tokens, temperature, top_p, seed, reasoning,
    model, concurrency, extra_body, api_key, ...; output (default OUTPUT/regenerated)."""

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
    engine: str = DEFAULT
    """What runs the target: hsx (its own engine: any Hugging Face causal LM through transformers, exact, no vLLM
    needed) or vllm (real vLLM with hsx's connector plug-in: vLLM's kernels, model coverage and parallelism; needs
    vLLM installed where the workers run, docs/engines.md), or another installed engine (`hsx.engines` entry points).
    The files, manifest and resume are the same."""
    tensor_parallel_size: int = 1
    """--engine vllm: devices one engine spans by tensor parallelism; each worker reserves tensor x pipeline
    parallel size devices on one node (GPUs; on CPU, cores) and runs vLLM's ranks inside."""
    pipeline_parallel_size: int = 1
    """--engine vllm: pipeline-parallel stages per engine (within one node)."""
    enable_expert_parallel: bool = False
    """--engine vllm: spread a MoE target's experts over the engine's ranks (vLLM's expert parallelism)."""
    vllm_args: dict[str, Any] = field(default_factory=dict)
    """--engine vllm: further vllm.LLM arguments as JSON, e.g. {"gpu_memory_utilization": 0.85, "quantization":
    "fp8", "max_num_seqs": 64}."""
    workers: int = 1
    """Extraction workers; each holds one engine (one model copy) for its lifetime. The job waits for this many."""
    max_workers: int | None = None
    """Grow the worker pool up to this many while work is queued and the cluster has room for another worker (an
    autoscaling cluster adds nodes for pending workers; nodes added mid-job get workers). Default: --workers, a
    fixed pool."""
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
    registry_shards: int = 4
    """Actors that decide which records to extract, skip or fail as duplicates (each holds 16 bytes per id it owns,
    plus about 1 MB): more for runs of tens of millions of samples."""

    layout: str = "files"
    """How samples are stored: files (one safetensors file per sample, vLLM's layout) or sharded (samples appended
    to shard objects of about --shard-mb, each sample's byte range in the manifest: few objects and PUT requests on
    object stores; every hsx reader reads a sample by range)."""
    shard_mb: float = 256.0
    """--layout sharded: a shard's size in MiB. A shard is one unit of work's samples, so this sets the unit of work
    (--tokens-per-task is not used): a worker that dies redoes at most its shard. Sized by the prompts' tokens: with
    --include-output-tokens a shard also holds the generated tokens' states, up to --max-tokens a sample more."""

    # -- bookkeeping -----------------------------------------------------------------------------------------------
    retry_failed: bool = False
    """Extract again the samples whose records failed in a way that repeats (malformed JSON, no known field, over the
    length limit, a duplicate id, ...): after fixing the corpus or a setting. Other failures (the engine, storage,
    a lost worker) are retried by every re-run."""
    fail_on_error: bool = False
    """Exit with status 1 when any sample failed (by default failures are recorded and the job succeeds)."""
    on_nonfinite: str = "fail"
    """A sample whose states hold NaN/Inf or an all-zero layer (never written): fail (a "failed" row, extracted
    again by a resume) or skip (a "skipped" row naming token and layer: final, never extracted again, not a
    failure for --fail-on-error)."""
    storage_retry_seconds: float = 120.0
    """How long a failing write to --output is retried (backoff doubling up to 10 s apart) before the sample fails —
    or, for a manifest commit, the job: an outage of the store up to that long costs time, not samples."""
    manifest_flush_rows: int = 1000
    """Commit manifest rows at least every this many samples."""
    manifest_flush_seconds: float = 30.0
    """Commit manifest rows at least this often; a crash redoes at most this much work."""
    compact: bool = True
    """Merge the manifest's parts into a few large sorted ones when the job ends (`hsx compact`): a run opens
    faster; every row is kept."""
    progress: bool = True
    """Show a progress bar (samples/s, tokens/s, bytes, ETA) on stderr."""
    verbose: bool = False
    """Show Ray's own console output as well (its workers' output and logs, its notices and warnings); by default
    the console shows hsx's lines alone and Ray's stay in its session logs (/tmp/ray/session_latest/logs)."""
    break_lease: bool = False
    """Take over the output's writer lease even though its holder looks alive (use only when that job is known to
    be gone; a lease whose process died, or that was not renewed for 5 minutes, is broken without this)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("corpus", "regenerate_with"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(str(c) for c in value))
        object.__setattr__(self, "corpus_storage_options",
                           parse_storage_options(self.corpus_storage_options, "--corpus-storage-options"))
        object.__setattr__(self, "regenerate", parse_storage_options(self.regenerate, "--regenerate",
                                                                     example='{"max_tokens": 2048}'))
        if self.overlength not in OVERLENGTH_POLICIES:
            raise ValueError(f"--overlength {self.overlength!r} is not a policy; use truncate or skip")
        if self.layout not in LAYOUTS:
            raise ValueError(f"--layout {self.layout!r} is not a layout; use files (a file per sample, the default) "
                             "or sharded (shard objects of about --shard-mb)")
        if not self.shard_mb > 0:
            raise ValueError(f"--shard-mb must be > 0, got {self.shard_mb}")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"--on-nonfinite {self.on_nonfinite!r} is not a policy; use fail (a failed row, retried "
                             "on resume) or skip (a skipped row, final)")
        for name in ("workers", "tokenizer_workers", "tokens_per_task", "manifest_flush_rows", "registry_shards"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.max_workers is not None and int(self.max_workers) < int(self.workers):
            raise ValueError(f"--max-workers {self.max_workers} is below --workers {self.workers}; the pool grows "
                             "from --workers to --max-workers")
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise ValueError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")
        if self.cpus_per_worker is not None and self.cpus_per_worker < 0:
            raise ValueError(f"--cpus-per-worker must be >= 0, got {self.cpus_per_worker}")
        if not self.storage_retry_seconds > 0:
            raise ValueError(f"--storage-retry-seconds must be > 0, got {self.storage_retry_seconds}")
        if self.manifest_flush_seconds <= 0:
            raise ValueError(f"--manifest-flush-seconds must be > 0, got {self.manifest_flush_seconds}")
        if self.regenerate_with:
            if self.max_tokens:
                raise ValueError("--regenerate-with extracts the servers' answers prefill-only, so --max-tokens (the "
                                 "engine's own generation) must stay 0; set the servers' with --regenerate "
                                 "'{\"max_tokens\": N}'")
            self.regenerate_config()
        elif self.regenerate:
            raise ValueError("--regenerate sets hsx regenerate's options; pass --regenerate-with URL as well")
        if self.include_output_tokens and self.max_tokens == 0:
            raise ValueError("--include-output-tokens needs generated tokens; pass --max-tokens K (K > 0) as well")
        if self.max_model_len is not None and self.max_tokens >= self.max_model_len:
            raise ValueError(f"--max-tokens {self.max_tokens} leaves no room for a prompt within --max-model-len "
                             f"{self.max_model_len}; lower --max-tokens or raise --max-model-len")
        if not self.id_field:
            raise ValueError("--id-field is empty; name the record field holding sample ids (default: id)")
        object.__setattr__(self, "vllm_args", parse_storage_options(self.vllm_args, "--vllm-args",
                                                                    example='{"gpu_memory_utilization": 0.85}'))
        self.engine_settings()
        self.sampling_params()
        self.check_engine()  # the engine's and the connector's own checks, on the objects the workers will get

    def connector_settings(self) -> dict[str, Any]:
        return {**super().connector_settings(), "write_retry_s": float(self.storage_retry_seconds)}

    def engine_kind(self) -> EngineKind:
        """--engine's kind (extractor.engines: the `hsx.engines` entry points); ValueError listing the engines there
        are for a name that is none of them."""
        return engine_kind(self.engine)

    def engine_settings(self) -> Any:
        """The engine's settings from this job's flags (--engine vllm: vllm_engine.options.VllmSettings; hsx: None);
        ValueError naming the flag that does not fit the engine."""
        return self.engine_kind().settings(EngineFlags(
            tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel, vllm_args=dict(self.vllm_args), target=self.target))

    def regenerate_config(self):
        """hsx regenerate's settings for --regenerate-with (regeneration.config.RegenerateConfig)."""
        opts = dict(self.regenerate)
        fixed = {"server", "corpus", "corpus_storage_options", "id_field", "progress"}
        known = {f.name for f in dataclasses.fields(RegenerateConfig)} - fixed
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ValueError(f"--regenerate: unknown settings {unknown}; hsx regenerate takes {sorted(known)}")
        opts.setdefault("output", self.output.rstrip("/") + "/regenerated" if self.output else "")
        opts.setdefault("storage_options", self.storage_options)
        opts.setdefault("flush_seconds", 2.0)  # the extraction follows the commits: small ones, often
        opts.setdefault("tokenizer", self.model)  # the answers' ids checked against their text
        opts.setdefault("tokenizer_revision", self.revision)
        opts.setdefault("trust_remote_code", self.trust_remote_code)
        try:
            return RegenerateConfig(server=self.regenerate_with, corpus=self.corpus, id_field=self.id_field,
                                    corpus_storage_options=self.corpus_storage_options, progress=False, **opts)
        except ValueError as e:
            raise ValueError(f"--regenerate: {e}") from None

    def sampling_params(self):
        """The SamplingParams every sample runs with (each gets its own kv_transfer_params on top)."""
        from extractor.sampling import SamplingParams  # imports torch: loaded when a job is built, not for --help

        return flag_errors(self, SamplingParams, max_tokens=self.max_tokens, temperature=self.temperature,
                            top_p=self.top_p, top_k=self.top_k, seed=self.seed)

    def check_required(self, names: tuple[str, ...] = ("model", "corpus", "output")) -> None:
        """Raise ValueError naming the first missing required setting (flag or job-file key)."""
        for name in names:
            if not getattr(self, name):
                raise ValueError(f"{flag(name)} is required (or key {name!r} in the --config file)")

    def check_engine_installed(self) -> None:
        """ValueError (one line) when the engine runs on a private local Ray and does not import here (--engine vllm
        without vLLM); on a cluster of one's own (--address, $RAY_ADDRESS) the workers' environment decides."""
        if not (self.address or os.environ.get("RAY_ADDRESS")):
            missing = self.engine_kind().missing()
            if missing:
                raise ValueError(f"--engine {self.engine}: {missing}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values, keyed by field name (the job-file format)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


# -- the other commands' settings ------------------------------------------------------------------------------
@dataclass(frozen=True)
class EstimateConfig(JobConfig):
    """`hsx estimate`: a job's settings, plus how much of the corpus to tokenize."""

    limit: int | None = None
    """Tokenize only the first N records and extrapolate (default: all of them)."""
    json: bool = False
    """Print the estimate as JSON."""
    device_memory: str | None = None
    """Memory of the device an engine rank runs on (e.g. 80GiB, 141GB): adds whether the target fits it at --dtype,
    the smallest tensor-parallel size that does, and which engine runs that (weights, cache and activations are
    printed in any case)."""
    gpu_memory_utilization: float = 0.9
    """Share of --device-memory the engine may use (vLLM's gpu_memory_utilization)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device_memory is not None:
            from jobs.device_fit import parse_size

            if parse_size(self.device_memory) <= 0:
                raise ValueError(f"--device-memory {self.device_memory!r} is no memory; give the device's size, e.g. "
                                 "80GiB")


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
        object.__setattr__(self, "storage_options", parse_storage_options(self.storage_options, "--storage-options"))
        if self.errors < 0:
            raise ValueError(f"--errors must be >= 0, got {self.errors}")


@dataclass(frozen=True)
class CompactConfig:
    """`hsx compact OUTPUT`."""

    output: str = field(metadata={"cli": {"positional": True}})
    """The run's output folder or URL."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for OUTPUT, as JSON."""
    rows_per_part: int = 2_000_000
    """Rows per merged part (each a sorted range of sample ids; parts are read concurrently)."""
    break_lease: bool = False
    """Take over the output's writer lease even though its holder looks alive (only when that job is gone)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "storage_options", parse_storage_options(self.storage_options, "--storage-options"))
        if self.rows_per_part < 1:
            raise ValueError(f"--rows-per-part must be >= 1, got {self.rows_per_part}")


@dataclass(frozen=True)
class DemoConfig:
    """`hsx demo DIR`."""

    dir: str = field(metadata={"cli": {"positional": True}})
    """Working folder (created): the tiny model, the corpus and the run go there."""
    workers: int = 1
    """Extraction workers."""
    progress: bool = True
    """Show a progress bar."""
    verbose: bool = False
    """Show Ray's own console output (and the model build's) as well, as `hsx run --verbose`."""

    def __post_init__(self) -> None:
        if not self.dir:
            raise ValueError("DIR is empty; pass a working folder, e.g. hsx demo ./hsx-demo")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
