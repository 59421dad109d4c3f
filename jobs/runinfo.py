"""run.json for a job: the RunSpec a job's settings make, written once when a run starts, checked by every resume.

    build_run_spec(config, facts, files, template, template_source) -> RunSpec
    ensure_run_spec(run, spec)   writes run.json (True), or checks a present one (False); RunMismatch when they differ

The format itself (fields, versions, JSON) belongs to `connectors.run`. A resume is refused when anything that shapes
the stored files changed — model (id, revision, weights, quantization), layer ids, dtype, chat template, generation
settings, id field — since mixing files of two settings in one run is silent corruption for a trainer. Corpus, worker
counts and length limits may change between resumes: the corpus list is recorded, not compared. A run.json without
model_quantization (runs before it, and every unquantized model's) reads as not quantized.
"""

from __future__ import annotations

import hashlib
import platform
import time
from types import EllipsisType

from connectors.fingerprint import FINGERPRINT_SCHEME
from connectors.manifest import manifest_parts
from connectors.run import RUN_JSON, RunDir, RunSpec, Sampling, read_run_spec, write_run_spec
from corpus.readers import CorpusFile
from jobs.config import JobConfig
from jobs.model import ModelFacts

# RunSpec field -> the flag a user changes to change it
IDENTITY = {
    "model": "--model", "model_revision": "--revision",
    "model_quantization": "--model (a checkpoint quantized otherwise: its config.json's quantization_config)",
    "model_fingerprint": "--model (its weights, config or tokenizer changed since the run began)",
    "engine_quantization": "--vllm-args' quantization (vLLM quantizing the weights as it loads them)",
    "layer_ids": "--layers", "dtype": "--dtype", "storage_dtype": "--storage-dtype", "target": "--target",
    "chat_template_sha256": "--chat-template",
    "max_tokens": "--max-tokens", "include_output_tokens": "--include-output-tokens",
    "sampling": "--temperature/--top-p/--top-k/--seed", "id_field": "--id-field", "storage_layout": "--layout",
    "image_processing": "--model (its image processor's pixel limits, preprocessor_config.json)",
    "mm_embeds": "--mm-embeds",
}


class RunMismatch(ValueError):
    """The output holds a run made with different settings; resuming into it would mix incompatible files."""


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("hsx", "torch", "transformers", "ray", "safetensors", "pyarrow"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = ""
    return out


def corpus_fingerprint(files: list[CorpusFile], sizes: list[int | None]) -> str:
    digest = hashlib.sha256()
    for f, size in zip(files, sizes):
        digest.update(f"{f.url}\t{size}\n".encode())
    return digest.hexdigest()[:16]


def build_run_spec(config: JobConfig, facts: ModelFacts, files: list[CorpusFile], template: str | None,
                   template_source: str, sizes: list[int | None] | None = None, *,
                   present: RunSpec | None = None) -> RunSpec:
    """The RunSpec of this job; `present` (the run.json already there) picks the fingerprint scheme to compare with."""
    sizes = sizes or [None] * len(files)
    legacy = present is not None and not present.model_fingerprint.startswith(FINGERPRINT_SCHEME)
    sampling = None
    if config.max_tokens:
        sampling = Sampling(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, seed=config.seed)
    return RunSpec.from_file_spec(
        facts.file_spec(config.storage_dtype), model_fingerprint=facts.legacy_fingerprint if legacy else facts.fingerprint,
        model_quantization=facts.quantization, engine_quantization=engine_quantization(config),
        chat_template_source=template_source,
        chat_template_sha256=hashlib.sha256(template.encode()).hexdigest() if template else None,
        max_model_len=facts.max_model_len, overlength=config.overlength, max_tokens=config.max_tokens,
        include_output_tokens=config.include_output_tokens, sampling=sampling, id_field=config.id_field,
        storage_layout=config.layout, image_processing=_image_processing(config, facts),
        mm_embeds=bool(config.mm_embeds and facts.multimodal),
        corpus=tuple(f.url for f in files), corpus_fingerprint=corpus_fingerprint(files, sizes),
        versions=_versions(), created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def engine_quantization(config: JobConfig) -> str:
    """What the engine does to the weights beyond the checkpoint, as run.json records it: vLLM's on-the-fly
    quantization (--engine vllm --vllm-args '{"quantization": "fp8"}'); "" for none (hsx's engine runs the checkpoint
    as transformers loads it: a quantized one is said in the worker's log, and run.json's model_quantization)."""
    return config.engine_kind().quantization(config.engine_settings())


def _image_processing(config: JobConfig, facts: ModelFacts) -> dict[str, int]:
    """A vision-language target's pixel limits (run.json records them); {} for text targets."""
    if not facts.multimodal:
        return {}
    from extractor.multimodal import image_processing

    try:
        return image_processing(facts.model, revision=config.revision, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {config.model!r} is a vision-language target whose image processor cannot be "
                         f"read ({e}); its folder needs preprocessor_config.json") from e


def ensure_run_spec(run: RunDir, spec: RunSpec, present: RunSpec | None | EllipsisType = ...) -> bool:
    """Write run.json for a new run (returns True), or check that a present one matches (returns False).

    `present`: the run.json the caller already read (None: there is none); left out, it is read here.

    An output with manifest parts but no run.json (deleted, or lost in a copy) is refused: starting a "new" run there
    would extract every committed sample again beside the old rows.
    """
    if present is ...:
        present = read_run_spec(run)
    if present is None:
        if manifest_parts(run):
            raise RunMismatch(f"{run.url} has a manifest ({len(manifest_parts(run))} parts) but no {RUN_JSON}: it "
                              f"was deleted or not copied. Restore {RUN_JSON} to resume this run (its files and rows "
                              "are intact), or pick a new --output")
        write_run_spec(run, spec)
        return True
    diffs = present.differences(spec, list(IDENTITY))
    if "model_quantization" in diffs:
        diffs.pop("model_fingerprint", None)  # config.json changed with it: the quantization says how
    if diffs:
        lines = "; ".join(f"{key}: run has {_show(old, key)}, this job has {_show(new, key)} ({IDENTITY[key]})"
                          for key, (old, new) in diffs.items())
        raise RunMismatch(f"cannot resume into {run.url}: it was made with different settings — {lines}. Re-run "
                          "with the run's settings to resume it, or pick a new --output")
    return False


def _show(value, key: str = "") -> str:
    if key in ("model_quantization", "engine_quantization"):
        return repr(value) if value else "none (not quantized)"
    return repr(list(value)) if isinstance(value, tuple) else repr(value)
