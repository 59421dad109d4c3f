"""run.json: what produced a run, written once when it starts, checked by every resume.

    build_run_info(config, facts, files, template) -> dict
    ensure_run_info(output, info)      writes run.json, or checks a present one; RunMismatch when they differ

A resume is refused when anything that shapes the stored files changed — model (id, revision, weights), layer ids,
dtype, chat template, generation settings, id field — since mixing files of two settings in one run is silent
corruption for a trainer. Corpus, worker counts and length limits may change between resumes: the corpus list is
recorded, not compared.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from typing import Any

from connectors.format import FORMAT_NAME, FORMAT_VERSION, LAYER_ID_CONVENTION
from jobs.config import JobConfig
from jobs.corpus import CorpusFile
from jobs.layout import DATA_DIR, MANIFEST_DIR, RUN_JSON, Output
from jobs.model import ModelFacts

RUN_FORMAT = "hsx.run"
RUN_FORMAT_VERSION = "1"

# run.json key -> the flag a user changes to change it
IDENTITY = {
    "model": "--model", "model_revision": "--revision", "model_fingerprint": "--model (its weights or config)",
    "layer_ids": "--layers", "dtype": "--dtype", "chat_template_sha256": "--chat-template",
    "max_tokens": "--max-tokens", "include_output_tokens": "--include-output-tokens",
    "sampling": "--temperature/--top-p/--top-k/--seed", "id_field": "--id-field",
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


def build_run_info(config: JobConfig, facts: ModelFacts, files: list[CorpusFile], template: str | None,
                   template_source: str, sizes: list[int | None] | None = None) -> dict[str, Any]:
    sizes = sizes or [None] * len(files)
    sampling = None
    if config.max_tokens:
        sampling = {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
                    "seed": config.seed}
    return {
        "format": RUN_FORMAT, "format_version": RUN_FORMAT_VERSION,
        "file_format": FORMAT_NAME, "file_format_version": FORMAT_VERSION,
        "model": facts.model, "model_revision": facts.revision, "model_fingerprint": facts.fingerprint,
        "architecture": facts.architecture,
        "layer_ids": list(facts.layer_ids), "layer_id_convention": LAYER_ID_CONVENTION,
        "last_layer_normalized": False,
        "num_hidden_layers": facts.num_hidden_layers, "hidden_size": facts.hidden_size, "dtype": facts.dtype,
        "chat_template_source": template_source,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
        "max_model_len": facts.max_model_len, "overlength": config.overlength,
        "max_tokens": config.max_tokens, "include_output_tokens": config.include_output_tokens,
        "sampling": sampling, "id_field": config.id_field,
        "corpus": {"files": [f.url for f in files], "fingerprint": corpus_fingerprint(files, sizes)},
        "layout": {"data": f"{DATA_DIR}/<sha1(sample_id)[:2]>/<safe sample id>.safetensors",
                   "manifest": f"{MANIFEST_DIR}/ (Parquet; authoritative: a file counts only with an 'ok' row)"},
        "versions": _versions(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def read_run_info(output: Output) -> dict[str, Any] | None:
    if not output.exists(RUN_JSON):
        return None
    try:
        return json.loads(output.read_bytes(RUN_JSON))
    except json.JSONDecodeError as e:
        raise ValueError(f"{output.url_of(RUN_JSON)} is not valid JSON ({e}); it was not written by hsx, or was "
                         "edited. Use a new --output") from e


def ensure_run_info(output: Output, info: dict[str, Any]) -> bool:
    """Write run.json for a new run (returns True), or check that a present one matches (returns False)."""
    present = read_run_info(output)
    if present is None:
        output.put_atomic(RUN_JSON, (json.dumps(info, indent=2) + "\n").encode())
        return True
    if present.get("format") != RUN_FORMAT:
        raise RunMismatch(f"{output.url_of(RUN_JSON)} is not an hsx run file; use a new --output")
    diffs = [(key, present.get(key), info.get(key)) for key in IDENTITY if present.get(key) != info.get(key)]
    if diffs:
        lines = "; ".join(f"{key}: run has {old!r}, this job has {new!r} ({IDENTITY[key]})" for key, old, new in diffs)
        raise RunMismatch(f"cannot resume into {output.url}: it was made with different settings — {lines}. Re-run "
                          "with the run's settings to resume it, or pick a new --output")
    return False
