"""The run format: what an extraction run's OUTPUT holds. The one owner of it — the job writes through this module
and `connectors.manifest`, and every reader (dataset, exporters, `hsx status`, tests, benchmarks, examples) reads
through them.

    OUTPUT/run.json                                    RunSpec: what produced the run (versioned JSON)
    OUTPUT/data/<2 hex>/<digest>-<id>.safetensors      data_path(sample_id): one file per sample (see format.py)
    OUTPUT/manifest/                                   the commits (connectors.manifest): a data file counts only
                                                       with an "ok" row there

    RunDir(url, storage_options)         the output root: url_of(rel), exists, read_bytes, put (atomic), list,
                                         check_reachable (storage answers, bucket exists)
    as_run_dir(run, storage_options)     a RunDir, or the one given
    RunSpec                              frozen; to_json() / from_json(doc) / file_spec() / from_file_spec(spec)
    Sampling                             how generated tokens were drawn
    read_run_spec(run) / write_run_spec(run, spec)
    data_path(sample_id, layout)         a sample's file in the run's data layout
    RunFormatError                       run.json or the manifest is not something this hsx reads
    RUN_JSON, DATA_DIR, MANIFEST_DIR     the names under OUTPUT

Versions of run.json: 2 (written now) adds `data_layout`, the name of the data-file naming scheme (new runs:
"sha256/digest-stem", injective in the sample id); 1 (hsx 0.1's first round) is read with its own layout
"sha1-shard/safe-stem", under which two ids could share a file. Other versions are refused with a message naming
the versions this hsx reads. 3 is written for a run of `--layout sharded` (and `storage_layout: "sharded"`): hsx before it
refuses such a run instead of reading shards as files. This module never imports torch, transformers or ray (a
run.json's dtype is checked against torch's names, which loads torch, only when one is read).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from connectors import storage
from connectors.folders import DATA_DIR, RUN_JSON
from connectors.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LAYER_ID_CONVENTION,
    HiddenStatesSpec,
)
from connectors.paths import FILE_SUFFIX, id_digest

RUN_FORMAT = "hsx.run"
RUN_FORMAT_VERSION = "2"
SHARDED_RUN_FORMAT_VERSION = "3"
"""run.json of a run of --layout sharded: its rows point into shards, which hsx before it would read as files (and
its compaction would drop the rows' offsets), so it refuses version 3 and says to upgrade."""
READABLE_VERSIONS = ("1", "2", "3")
STORAGE_LAYOUTS = ("files", "sharded")
DATA_LAYOUT = "sha256/digest-stem"
"""data/<2 hex>/<sha256(id)[:32]>-<readable stem>.safetensors: injective in the exact id (the digest), and on
case-insensitive filesystems too (lower-case hex); the stem after it is for people browsing the folder."""
LEGACY_DATA_LAYOUT = "sha1-shard/safe-stem"
"""Version-1 runs: data/<first 2 hex of sha1(id)>/<sanitised id>.safetensors (two ids could share a file)."""
DATA_LAYOUTS = (DATA_LAYOUT, LEGACY_DATA_LAYOUT)
_READABLE = re.compile(r"[^A-Za-z0-9._-]")


class RunFormatError(ValueError):
    """run.json (or the manifest) is not something this hsx can read: not a run, corrupt, or a newer version."""


# -- the output root ----------------------------------------------------------------------------------------------


class RunDir:
    """An output root (local folder or any fsspec URL): relative paths to URLs, whole-file atomic writes."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        if not url:
            raise ValueError("--output is required: a local folder or a URL such as s3://bucket/run")
        self.storage_options = dict(storage_options or {})
        self.fs, root = storage.open_url(url, self.storage_options)
        self.local = storage.is_local(self.fs)
        self.root = os.path.abspath(root) if self.local else root.rstrip("/")
        self.url = storage.full_url(self.fs, self.root)

    def check_reachable(self) -> None:
        """ValueError naming the cause and the fix when this root cannot be used: its storage does not answer,
        refuses the credentials, or (object stores) its bucket does not exist. Costs one or two requests."""
        try:
            self.exists(RUN_JSON)
            if not self.local and storage.has_buckets(self.fs):
                bucket = self.root.lstrip("/").split("/", 1)[0]
                if bucket and not self.fs.exists(bucket):
                    raise ValueError(f"{self.url}: bucket {bucket!r} does not exist; create it first (e.g. `aws s3 mb "
                                     f"s3://{bucket}`), or fix the URL")
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - every storage client has its own errors: one message for all
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"cannot reach the storage of {self.url}: {type(e).__name__}: {first}. Check the "
                             "endpoint and credentials (--storage-options, or the environment's AWS_*/GOOGLE_* "
                             "settings)") from e

    def path(self, rel: str) -> str:
        """Protocol-less path for this filesystem."""
        return posixpath.join(self.root, rel)

    def url_of(self, rel: str) -> str:
        """URL of `rel` that storage.open_url maps back here (plain path for local roots)."""
        return storage.full_url(self.fs, self.path(rel))

    def exists(self, rel: str) -> bool:
        self.fs.invalidate_cache(self.path(rel))
        return self.fs.exists(self.path(rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def put(self, rel: str, data: bytes) -> None:
        """Write `rel` whole and durably: readers see the old state or the whole new file (storage.put_atomic)."""
        storage.put_atomic(self.fs, self.path(rel), data)

    def list(self, rel: str) -> list[str]:
        """Names directly under `rel` (not starting with "."), or [] when it does not exist."""
        path = self.path(rel)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        names = [posixpath.basename(e.rstrip("/")) for e in entries]
        return sorted(n for n in names if not n.startswith("."))


def as_run_dir(run: RunDir | str, storage_options: dict | None = None) -> RunDir:
    return run if isinstance(run, RunDir) else RunDir(str(run), storage_options)


def data_path(sample_id: str, layout: str = DATA_LAYOUT) -> str:
    """A sample's file, relative to the output root, in the run's `data_layout`."""
    if layout == DATA_LAYOUT:
        digest = id_digest(sample_id)
        readable = _READABLE.sub("_", str(sample_id)).lstrip(".")[:40] or "sample"
        return f"{DATA_DIR}/{digest[:2]}/{digest}-{readable}{FILE_SUFFIX}"
    if layout == LEGACY_DATA_LAYOUT:
        shard = hashlib.sha1(str(sample_id).encode("utf-8", "surrogatepass")).hexdigest()[:2]
        return f"{DATA_DIR}/{shard}/{_legacy_stem(sample_id)}{FILE_SUFFIX}"
    raise RunFormatError(f"data layout {layout!r} is unknown to this hsx (it knows {list(DATA_LAYOUTS)})")


def _legacy_stem(sample_id: str) -> str:
    """Version 1's file stem: the id if safe, else sanitised + sha1[:10] (not injective; kept to read old runs)."""
    sid = str(sample_id)
    stem = _READABLE.sub("_", sid).lstrip(".")[:120]
    if stem == sid and stem:
        return stem
    return f"{stem or 'request'}-{hashlib.sha1(sid.encode('utf-8', 'surrogatepass')).hexdigest()[:10]}"


# -- run.json -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How generated tokens were drawn (runs with max_tokens > 0)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


# the file spec's fields, read through RunSpec as its own (spec.layer_ids, spec.dtype, ...) and stored flat in JSON
FILE_FIELDS = ("layer_ids", "num_hidden_layers", "hidden_size", "dtype", "model", "model_revision",
               "last_layer_normalized", "storage_dtype", "target")
_OMITTED_WHEN_EMPTY = ("storage_dtype", "target")
"""Written only when set: run.json of a model-dtype, states-target run stays as it was before they existed."""
_JSON_SKIPPED = ("files", "format_version", "corpus", "corpus_fingerprint")
_JOB_OMITTED_WHEN_EMPTY = ("model_quantization", "engine_quantization", "image_processing", "mm_embeds", "plan_key")
"""Job fields written only when set: run.json of an unquantized model's run stays as it was before the field."""


@dataclass(frozen=True)
class RunSpec:
    """run.json: what produced a run. Written once when a run starts; every resume and every reader checks it.

    `files` is what every data file shares (the HiddenStatesSpec in each file's metadata; its fields read as the
    run's own: `spec.layer_ids`, `spec.dtype`, `spec.architecture`, ...); the rest records how the job made them.
    Runs written with the offline API alone (examples, fixtures) set `files` only. run.json stores it all flat.
    """

    files: HiddenStatesSpec
    """The file spec: layer ids, layer count, hidden size, dtype, model, revision, norm status, architecture."""
    layer_id_convention: str = LAYER_ID_CONVENTION
    """How `layer_ids` count; hsx writes "vllm" (0 = embeddings, k = output of decoder layer k-1, N pre-norm)."""
    model_fingerprint: str = ""
    """sha256 prefix of the model's config and weight files' names and sizes."""
    model_quantization: str = ""
    """The checkpoint's quantization_config in short ("fp8 (fmt=e4m3, ...)"); "" — and absent from run.json — when
    the model is not quantized (runs written before the field existed read as not quantized)."""
    engine_quantization: str = ""
    """What the engine did to the weights beyond the checkpoint: vLLM's on-the-fly quantization (`--vllm-args
    '{"quantization": "fp8"}'`) as "fp8 (vLLM, on the fly)"; "" — and absent from run.json — when none."""
    chat_template_source: str = "none"
    """Where the chat template came from: "tokenizer", a file, or "none"."""
    chat_template_sha256: str | None = None
    max_model_len: int | None = None
    """Longest sample in tokens the job allowed."""
    overlength: str = "truncate"
    max_tokens: int = 0
    """Tokens generated after each prompt (0 = prompt-only extraction)."""
    include_output_tokens: bool = False
    sampling: Sampling | None = None
    """How generated tokens were drawn; None for prompt-only runs."""
    id_field: str = "id"
    corpus: tuple[str, ...] = ()
    """Corpus files of the first attempt (recorded, not compared: a resume may add files)."""
    corpus_fingerprint: str = ""
    data_layout: str = DATA_LAYOUT
    """Naming scheme of the data files (see data_path)."""
    storage_layout: str = "files"
    """How samples are stored: "files" (one per sample) or "sharded" (connectors.shards; run.json version 3). (Not
    `layout`: version 1 used that key for a description of its folders.)"""
    mm_embeds: bool = False
    """An image run's files hold the merged input embeddings at image tokens (`hsx run --mm-embeds`)."""
    image_processing: Mapping[str, int] = field(default_factory=dict)
    """A vision-language target's image processor: its pixel limits and patching (min_pixels, max_pixels,
    patch_size, merge_size, ...), what every stored image was resized by; empty for text targets."""
    versions: Mapping[str, str] = field(default_factory=dict)
    """Package versions of the first attempt."""
    plan_key: str = ""
    """sha256 of what planned the first attempt (the job's settings, the model folder's and the corpus files' names,
    sizes and times, package versions; jobs.plan.plan_key): a re-run whose key matches needs no model loaded to know
    it is the same job (not compared on resume: a different key only means the full check runs)."""
    created_at: str = ""
    format_version: str = RUN_FORMAT_VERSION
    """The run.json version this spec was read from (always RUN_FORMAT_VERSION when written)."""

    def __post_init__(self) -> None:
        if not isinstance(self.files, HiddenStatesSpec):
            raise TypeError(f"RunSpec.files must be a HiddenStatesSpec, got {type(self.files).__name__}")
        object.__setattr__(self, "corpus", tuple(str(c) for c in self.corpus))
        if isinstance(self.sampling, Mapping):
            object.__setattr__(self, "sampling", Sampling(**self.sampling))
        if self.storage_layout not in STORAGE_LAYOUTS:
            raise RunFormatError(f"run.json names storage_layout {self.storage_layout!r}, unknown to this hsx (it reads "
                                 f"{list(STORAGE_LAYOUTS)}); upgrade hsx to read this run")
        if self.data_layout not in DATA_LAYOUTS:
            raise RunFormatError(f"run.json names data layout {self.data_layout!r}, unknown to this hsx (it reads "
                                 f"{list(DATA_LAYOUTS)}); upgrade hsx to read this run")

    def __getattr__(self, name: str) -> Any:
        # only reached for names that are not RunSpec's own fields: the file spec's, read as the run's
        if name in FILE_FIELDS and "files" in self.__dict__:
            return getattr(self.files, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- the file spec ------------------------------------------------------------------------------------------
    def file_spec(self) -> HiddenStatesSpec:
        """The HiddenStatesSpec every data file of the run carries."""
        return self.files

    @classmethod
    def from_file_spec(cls, spec: HiddenStatesSpec, **job: Any) -> RunSpec:
        """A RunSpec for files made with `spec`; `job` sets the job fields (model_fingerprint=..., max_tokens=...)."""
        return cls(files=spec, **job)

    @property
    def architecture(self) -> str:
        return self.files.extra.get("architecture", "")

    @property
    def torch_dtype(self):
        return self.files.torch_dtype

    @property
    def target_top_k(self) -> int | None:
        """K of a top-k target run (`HiddenStatesSpec.top_k`); None for a run that stores the states."""
        return self.files.top_k

    def data_path(self, sample_id: str) -> str:
        return data_path(sample_id, self.data_layout)

    def differences(self, other: RunSpec, names: Sequence[str]) -> dict[str, tuple[Any, Any]]:
        """{field: (self's value, other's value)} over `names` (the file spec's fields included)."""
        return {n: (getattr(self, n), getattr(other, n)) for n in names if getattr(self, n) != getattr(other, n)}

    # -- JSON ---------------------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The run.json document (version RUN_FORMAT_VERSION), flat."""
        version = SHARDED_RUN_FORMAT_VERSION if self.storage_layout == "sharded" else RUN_FORMAT_VERSION
        doc: dict[str, Any] = {"format": RUN_FORMAT, "format_version": version,
                               "file_format": FORMAT_NAME, "file_format_version": FORMAT_VERSION}
        for name in FILE_FIELDS:
            value = getattr(self.files, name)
            if name in _OMITTED_WHEN_EMPTY and not value:
                continue
            doc[name] = list(value) if isinstance(value, tuple) else value
        doc["architecture"] = self.architecture
        for f in dataclasses.fields(self):
            if f.name in _JSON_SKIPPED:
                continue
            value = getattr(self, f.name)
            if f.name in _JOB_OMITTED_WHEN_EMPTY and not value:
                continue
            if isinstance(value, Sampling):
                value = dataclasses.asdict(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            doc[f.name] = value
        doc["corpus"] = {"files": list(self.corpus), "fingerprint": self.corpus_fingerprint}
        return doc

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, doc: Any, where: str = RUN_JSON) -> RunSpec:
        """Parse a run.json document of any readable version; RunFormatError says what is wrong and what to do."""
        if not isinstance(doc, Mapping) or doc.get("format") != RUN_FORMAT:
            raise RunFormatError(f"{where} is not an hsx run file (no \"format\": \"{RUN_FORMAT}\"); it was not "
                                 "written by hsx — use a new --output, or pass the OUTPUT folder of an hsx run")
        version = str(doc.get("format_version"))
        if version not in READABLE_VERSIONS:
            raise RunFormatError(f"{where} has format_version {doc.get('format_version')!r}; this hsx reads versions "
                                 f"{', '.join(READABLE_VERSIONS)}. It was written by a newer hsx: upgrade hsx "
                                 "(pip install -U hsx) to read or resume this run")
        missing = [n for n in ("layer_ids", "num_hidden_layers", "hidden_size", "dtype") if n not in doc]
        if missing:
            raise RunFormatError(f"{where} lacks {missing}; it is damaged or was edited by hand — restore it, or "
                                 "re-extract into a new --output")
        bad = _bad_run_fields(doc)
        if bad:
            raise RunFormatError(f"{where} holds {len(bad)} bad field{'s' if len(bad) > 1 else ''}: "
                                 + "; ".join(bad) + ". It was damaged or edited by hand: put the values back (every "
                                 "data file's header records the run's own in its __metadata__), then run the "
                                 "command again; nothing was read or marked")
        values = {f.name: doc[f.name] for f in dataclasses.fields(cls) if f.name in doc and f.name not in _JSON_SKIPPED}
        corpus = doc.get("corpus") or {}
        if isinstance(corpus, Mapping):
            values["corpus"] = tuple(corpus.get("files") or ())
            values["corpus_fingerprint"] = str(corpus.get("fingerprint") or "")
        if version == "1":
            values["data_layout"] = LEGACY_DATA_LAYOUT  # version 1 had one layout and described it in prose
        try:
            files = HiddenStatesSpec(**{n: doc[n] for n in FILE_FIELDS if n in doc},
                                     extra={"architecture": doc["architecture"]} if doc.get("architecture") else {})
            return cls(files=files, **values, format_version=version)
        except (TypeError, ValueError) as e:
            raise RunFormatError(f"{where} holds an unreadable value: {e}") from e


_MODEL_DTYPES = frozenset({"float32", "float", "float64", "double", "float16", "half", "bfloat16", "float8_e4m3fn",
                           "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})
"""torch's floating dtype names: what a model's dtype in run.json may be (checked without importing torch)."""


def _is_torch_dtype(name: str) -> bool:
    return name in _MODEL_DTYPES


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str_map(v: Any) -> bool:
    return isinstance(v, Mapping) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _is_sampling(v: Any) -> bool:
    if v is None:
        return True
    if not isinstance(v, Mapping) or set(v) - {f.name for f in dataclasses.fields(Sampling)}:
        return False
    return (all(isinstance(v.get(n, 0.0), (int, float)) and not isinstance(v.get(n), bool)
                for n in ("temperature", "top_p")) and _is_int(v.get("top_k", 0))
            and (v.get("seed") is None or _is_int(v.get("seed"))))


def _is_corpus(v: Any) -> bool:
    return isinstance(v, Mapping) and isinstance(v.get("files", []), list) \
        and all(isinstance(f, str) for f in v.get("files", [])) and isinstance(v.get("fingerprint", ""), str)


_RUN_JSON_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "layer_ids": (lambda v: isinstance(v, list) and bool(v) and all(_is_int(x) and x >= 0 for x in v),
                  "a non-empty list of layer ids (integers >= 0)"),
    "num_hidden_layers": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "hidden_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "dtype": (lambda v: isinstance(v, str) and _is_torch_dtype(v), "a torch dtype name such as \"bfloat16\""),
    "model": (lambda v: isinstance(v, str), "a string"),
    "model_revision": (lambda v: isinstance(v, str), "a string"),
    "architecture": (lambda v: isinstance(v, str), "a string"),
    "last_layer_normalized": (lambda v: isinstance(v, bool), "true or false"),
    "storage_dtype": (lambda v: isinstance(v, str), "a string (\"\" = the model's dtype)"),
    "target": (lambda v: isinstance(v, str), "a string (\"\" or \"top_k:K\")"),
    "layer_id_convention": (lambda v: isinstance(v, str), "a string"),
    "model_fingerprint": (lambda v: isinstance(v, str), "a string"),
    "model_quantization": (lambda v: isinstance(v, str), "a string (\"\" = not quantized)"),
    "engine_quantization": (lambda v: isinstance(v, str), "a string (\"\" = none)"),
    "chat_template_source": (lambda v: isinstance(v, str), "a string"),
    "chat_template_sha256": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "max_model_len": (lambda v: v is None or (_is_int(v) and v >= 1), "an integer >= 1 or null"),
    "overlength": (lambda v: isinstance(v, str), "a string"),
    "max_tokens": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "include_output_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "sampling": (_is_sampling, "null or {temperature, top_p, top_k, seed} with numbers"),
    "id_field": (lambda v: isinstance(v, str), "a string"),
    "corpus": (_is_corpus, "{\"files\": [paths], \"fingerprint\": string}"),
    "data_layout": (lambda v: isinstance(v, str), "a string"),
    "storage_layout": (lambda v: isinstance(v, str), "a string"),
    "mm_embeds": (lambda v: isinstance(v, bool), "true or false"),
    "image_processing": (lambda v: isinstance(v, Mapping) and all(isinstance(k, str) and _is_int(x)
                                                                  for k, x in v.items()),
                         "an object of integers (pixel limits)"),
    "versions": (_is_str_map, "an object of package name -> version string"),
    "created_at": (lambda v: isinstance(v, str), "a string"),
    "plan_key": (lambda v: isinstance(v, str), "a string"),
}
"""What each run.json field must hold; from_json checks every field present and names each bad one."""


def _bad_run_fields(doc: Mapping[str, Any]) -> list[str]:
    """One line per run.json field whose value is of the wrong kind: the field, what it holds, what it must be."""
    bad = []
    for name, (ok, expected) in _RUN_JSON_FIELDS.items():
        if name in doc and not ok(doc[name]):
            shown = json.dumps(doc[name], ensure_ascii=False, default=str)
            bad.append(f"{name!r} is {shown[:80] + ('...' if len(shown) > 80 else '')}, expected {expected}")
    return bad


def read_run_spec(run: RunDir | str, storage_options: dict | None = None) -> RunSpec | None:
    """The run's RunSpec, or None when it has no run.json."""
    run = as_run_dir(run, storage_options)
    if not run.exists(RUN_JSON):
        return None
    where = run.url_of(RUN_JSON)
    try:
        doc = json.loads(run.read_bytes(RUN_JSON))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested past json's
        detail = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise RunFormatError(f"{where} is not valid JSON ({detail}); it was not written by hsx, or was damaged — "
                             "restore it, or use a new --output") from None
    return RunSpec.from_json(doc, where)


def write_run_spec(run: RunDir | str, spec: RunSpec, storage_options: dict | None = None) -> None:
    as_run_dir(run, storage_options).put(RUN_JSON, spec.to_bytes())
