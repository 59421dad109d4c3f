"""Engine configuration: the typed form of what `LLM(...)` accepts, validated up front.

    EngineConfig                          every engine setting, checked in __post_init__
    SpeculativeConfig                     speculative decoding (ngram, draft_model, or a registered drafter family)
    checkpoint_method(dir)                the method a draft checkpoint is for (vLLM's inference when 'method' is unset)
    speculative_config_from_dict(spec)    vLLM's speculative_config dict -> (SpeculativeConfig | None, layer ids)
    layer_ids_from_speculative_config     vLLM's speculative_config dict -> layer ids (None = default)
    canonical_dtype(name)                 the one dtype-name table (aliases such as bf16), used by engine and jobs
    resolve_dtype(name, hf_config)        "auto" -> the checkpoint's dtype, the one rule engine and jobs share

`LLM(**vllm_style_kwargs)` builds an EngineConfig; `LLM.from_config(EngineConfig, ...)` takes one directly (jobs do),
so every error names the argument to change and nothing is parsed twice.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from connectors.format import check_layer_ids, check_target
from extractor.media import MediaPolicy
from extractor.methods import families

PACKING_MODES = ("auto", "on", "off")
"""EngineConfig.packing (extractor.packing: how prompt-only batches are laid out)."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
STORED_DTYPES = DTYPES[1:]
# Unambiguous aliases only: "float" and "double" are refused (torch reads "float" as float32, users often mean fp16).
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
SPECULATIVE_METHOD = "extract_hidden_states"
ENGINE_METHODS = ("ngram", "draft_model")
"""Speculative methods the engine drafts for itself; the trained-head ones (every drafter family) come
from the drafter registry (extractor/methods.py). extract_hidden_states is not a speculative decoding method."""
_SPEC_KEYS = {"ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"),
              "draft_model": ("method", "num_speculative_tokens", "model")}
_DRAFTER_KEYS = ("method", "num_speculative_tokens", "model", "parallel_drafting")


def drafter_methods() -> tuple[str, ...]:
    """Methods whose draft is a head trained on the target's states (`model` = its checkpoint): the registry's."""
    return tuple(sorted(families()))


def speculation_methods() -> tuple[str, ...]:
    """Every speculative decoding method: the engine's own, then the registered drafter families."""
    return ENGINE_METHODS + drafter_methods()
# vLLM keys the seed passes that change nothing hsx computes: accepted with one warning. value None = any value;
# otherwise the one value hsx can honour.
_SPEC_IGNORED = {"enforce_eager": None, "disable_padded_drafter_batch": None, "max_model_len": None,
                 "parallel_drafting": False, "use_heterogeneous_vocab": False}

logger = logging.getLogger(__name__)


def canonical_dtype(name: Any, *, flag: str = "dtype") -> str:
    """"auto" or a stored dtype name for `name` (a str, alias or torch dtype); ValueError naming `flag` otherwise."""
    text = str(name).removeprefix("torch.")
    text = _DTYPE_ALIASES.get(text, text)
    if text not in DTYPES:
        raise ValueError(f"{flag} {name!r} is not supported; use one of {', '.join(DTYPES)} (aliases: "
                         f"{', '.join(sorted(_DTYPE_ALIASES))})")
    return text


def resolve_dtype(name: str, hf_config: Any) -> str:
    """The dtype the engine runs and stores in: `name` unless "auto"; "auto" is the checkpoint's own dtype when it is
    float32, bfloat16 or float16, else float32 (a float64 or quantised checkpoint runs in float32)."""
    name = canonical_dtype(name)
    if name != "auto":
        return name
    raw = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    raw = str(raw).removeprefix("torch.")
    return raw if raw in STORED_DTYPES else "float32"


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """A local model folder or a hub id (hub ids need network access, which tests never have)."""
    layer_ids: tuple[int, ...] | None = None
    """Hidden-state ids to capture (0 = embeddings, k = output of decoder layer k-1, N = last layer pre-norm);
    None = the EAGLE-3 default [2, N//2, N-3, N]."""
    dtype: str = "auto"
    """Model and stored dtype: "auto" (the checkpoint's), "float32", "bfloat16" or "float16"."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; default the model's max_position_embeddings."""
    max_num_batched_tokens: int = 8192
    """Token budget of one forward (batch rows x columns); longer prompts are prefilled in chunks."""
    max_num_seqs: int = 256
    """Most requests in one batch."""
    device: str | None = None
    """"cuda", "cuda:1", "cpu"; None = CUDA when available."""
    attn_implementation: str | None = None
    """Passed to transformers ("sdpa", "eager", "flash_attention_2"); None = transformers' default."""
    revision: str | None = None
    """Model revision (branch, tag or commit) for hub ids."""
    tokenizer: str | None = None
    """Tokenizer folder or id; default the model's."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the model folder."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (ngram or draft_model); None = plain decoding. Such an engine writes no hidden states."""
    target: str = ""
    """What the files keep of the last layer N: "" / "states" = its state when layer_ids list it, or "top_k:K" = the
    target's top-K next-token log-probabilities (N through the final norm and lm_head) in its place (EAGLE-3)."""
    packing: str = "auto"
    """Prompt-only batches: "auto" packs the prompts end to end without padding where that is exact for the target
    (extractor.packing; else padded), "on" refuses a target that cannot be packed, "off" always pads."""
    media: MediaPolicy = field(default_factory=MediaPolicy)
    """What image prompts may bring (vLLM's media settings): limit_mm_per_prompt, allowed_local_media_path, whether
    http(s) images are fetched and from which hosts (allowed_media_domains), the fetch deadline and the decoded-size
    budgets per image and per prompt (extractor.media)."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model is empty; pass a local model folder or a hub id")
        object.__setattr__(self, "target", check_target(self.target))
        if self.speculative is not None and self.target:
            raise ValueError(f"target {self.target!r} with speculative method {self.speculative.method!r}: a speculative "
                             "engine writes no files; set the target on the extraction engine")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise TypeError(f"speculative must be an extractor.SpeculativeConfig, got {type(self.speculative).__name__}")
        if self.speculative is not None and self.layer_ids is not None:
            raise ValueError(f"layer_ids {self.layer_ids} and speculative method {self.speculative.method!r} in one "
                             f"engine: extraction ({SPECULATIVE_METHOD}) and speculative decoding are separate engines; "
                             "build one LLM for each")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.layer_ids is not None:
            # the range needs the model's layer count: checked again, with it, when the model's config is read
            object.__setattr__(self, "layer_ids", check_layer_ids(self.layer_ids, name="eagle_aux_hidden_state_layer_ids",
                                                                  defer_range=True))
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.packing not in PACKING_MODES:
            raise ValueError(f"packing must be one of {', '.join(PACKING_MODES)}, got {self.packing!r}")
        if not isinstance(self.media, MediaPolicy):
            raise TypeError(f"media must be an extractor.media.MediaPolicy, got {type(self.media).__name__}")


NGRAM_DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given
MAX_SPECULATIVE_TOKENS = 128
"""The most tokens drafted per step hsx accepts: past it every step's k draft positions and buffers cost memory and
time before anything runs (10^9 took 8 GB), and no drafter family drafts that many (DFlash's blocks: 16)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts `num_speculative_tokens` tokens, one target forward verifies them."""

    method: str
    """"ngram" (prompt lookup in the request's own tokens), "draft_model" (a smaller causal LM, same vocabulary), or a
    head trained on the target's states: a drafter family's name (extractor/methods.py's registry, filled by drafters/)."""
    num_speculative_tokens: int
    """k, tokens drafted per step (>= 1)."""
    prompt_lookup_max: int | None = None
    """ngram: longest suffix n-gram tried first. Resolved as vLLM does: given alone, the other bound equals it;
    neither given, both are 5 (vLLM's spec_decode_offline.py passes 5 and 2 explicitly)."""
    prompt_lookup_min: int | None = None
    """ngram: shortest suffix n-gram tried; no match of any length = no draft this step."""
    model: str | None = None
    """draft_model: a local folder holding the draft causal LM (its vocabulary must equal the target's); a drafter
    family: the trained head's checkpoint folder (`hsx train-drafter --out`)."""
    parallel_drafting: bool = False
    """vLLM's flag: all k drafts from one drafter forward. Only for a checkpoint trained for it (P-EAGLE: method
    "peagle", or "eagle3" on a P-EAGLE checkpoint, which becomes "peagle"); a family that drafts in parallel sets
    it itself."""

    def __post_init__(self) -> None:
        if self.method not in speculation_methods():
            raise ValueError(f"speculative method {self.method!r} is not supported; valid: "
                             f"{', '.join(speculation_methods())} (and {SPECULATIVE_METHOD} for extraction)")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={k} is more than the {MAX_SPECULATIVE_TOKENS} tokens hsx drafts "
                             "per step; drafters propose 1-16 (3-5 is usual)")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            given = ", ".join(f"{n}={v!r}" for n, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi))
                              if v is not None)
            if not all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1) for v in (lo, hi)) \
                    or (lo is not None and hi is not None and lo > hi):
                raise ValueError(f"{given}: need integers with 1 <= prompt_lookup_min <= prompt_lookup_max (e.g. 2 "
                                 f"and 5; one alone sets both, neither means {NGRAM_DEFAULT_LOOKUP})")
            if lo is None and hi is None:
                lo = hi = NGRAM_DEFAULT_LOOKUP
            object.__setattr__(self, "prompt_lookup_min", hi if lo is None else lo)
            object.__setattr__(self, "prompt_lookup_max", lo if hi is None else hi)
        if self.method == "draft_model" or self.method in drafter_methods():
            what = "the draft causal LM" if self.method == "draft_model" else f"the {self.method} checkpoint"
            if not self.model and model_optional(self.method):  # the target's own folder holds the draft
                if self.parallel_drafting:
                    raise ValueError(f"parallel_drafting applies to a head trained to draft in parallel, not to "
                                     f"method {self.method!r}; drop it")
                return
            if not self.model:
                raise ValueError(f"method {self.method!r} needs 'model': a local folder with {what}")
            if not os.path.isdir(str(self.model)):
                raise ValueError(f"draft model {self.model!r} does not exist or is not a folder; pass a local folder "
                                 f"holding {what} (config.json and weights; hub ids are not fetched for drafts)")
            if not isinstance(self.parallel_drafting, bool):
                raise ValueError(f"parallel_drafting must be true or false, got {self.parallel_drafting!r}")
            found = checkpoint_method(str(self.model))
            if model_optional(self.method) and found != self.method:
                found = self.method  # a target folder: its own reader names what it lacks (method mtp: MTP layers)
            parallel_of, parallel = _parallel_of(found)
            if self.parallel_drafting and found != self.method and parallel_of == self.method:
                object.__setattr__(self, "method", found)  # vLLM's eagle3 + parallel_drafting on a P-EAGLE head
            target_folder = model_optional(found) and _recorded_kind(str(self.model)) != found  # not a tuned head
            if found != self.method and not (self.method == "draft_model" and target_folder):
                hint = " or add parallel_drafting: true" if parallel_of == self.method else ""
                raise ValueError(f"speculative method {self.method!r} but {self.model} holds "
                                 f"{_describe_checkpoint(found)}; use method {found!r} for it{hint}, or point "
                                 f"'model' at {what}")
            if self.parallel_drafting and not parallel:
                raise ValueError(f"parallel_drafting: {self.model} holds {_describe_checkpoint(found)}, which drafts "
                                 "one token per forward (it was not trained to draft in parallel: no mask state); "
                                 "train one with `hsx train-drafter --kind peagle` (or dflash), or drop "
                                 "parallel_drafting")
            object.__setattr__(self, "parallel_drafting", parallel)
        elif self.parallel_drafting:
            raise ValueError(f"parallel_drafting applies to a head trained for it (method peagle, or eagle3 on a "
                             f"P-EAGLE checkpoint), not to method {self.method!r}; drop it")


def _recorded_kind(model_dir: str) -> str | None:
    """The family hsx recorded in a checkpoint's config.json ("hsx": {"kind": ...}), if any."""
    raw = _read_checkpoint_config(model_dir)
    return raw["hsx"].get("kind") if isinstance(raw.get("hsx"), dict) else None


def model_optional(method: str | None) -> bool:
    """Whether the family `method` reads its draft from the target's own folder when 'model' is left out (mtp);
    such a folder is also a causal LM, so draft_model may name it."""
    return bool(getattr(families().get(method) if method else None, "model_optional", False))


def _parallel_of(method: str | None) -> tuple[str | None, bool]:
    """(the method whose parallel_drafting a family's checkpoints serve, whether it drafts all k tokens in one
    forward) of the family `method`."""
    found = families().get(method) if method else None
    return getattr(found, "parallel_of", None), bool(getattr(found, "parallel", False))


def _read_checkpoint_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{model_dir} has no config.json; a draft folder holds config.json and its weights") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    return raw


def checkpoint_method(model_dir: str) -> str | None:
    """The speculative method a draft checkpoint is for, from its config.json (as vLLM infers it): the drafter
    family whose checkpoints it matches (the one hsx recorded when several do), any causal LM -> "draft_model"; None
    when the config is none of these."""
    raw = _read_checkpoint_config(model_dir)
    matching = [name for name, family in sorted(families().items()) if family.matches(raw)]
    recorded = raw["hsx"].get("kind") if isinstance(raw.get("hsx"), dict) else None
    if recorded in matching:  # hsx's own checkpoints name their family (one may share another's layout)
        return recorded
    if matching:
        return matching[0]
    if any(str(a).endswith("ForCausalLM") for a in raw.get("architectures") or []):
        return "draft_model"
    return None


def checkpoint_num_speculative_tokens(model_dir: str) -> int | None:
    """The k a drafter checkpoint was built for (MLPSpeculator n_predict, Medusa num_heads, the speculators config's
    speculative_tokens), None when it does not say."""
    method = checkpoint_method(model_dir)
    family = families().get(method) if method else None
    return family.num_speculative_tokens(_read_checkpoint_config(model_dir)) if family is not None else None


def _describe_checkpoint(method: str | None) -> str:
    if method == "draft_model":
        return "a causal LM (a draft_model draft)"
    if method is None:
        return f"no checkpoint hsx recognises (not a causal LM, nor one of {', '.join(drafter_methods())})"
    found = families().get(method)
    return found.description if found is not None else f"a {method} checkpoint"


def speculative_config_from_dict(spec: Mapping[str, Any] | None
                                 ) -> tuple[SpeculativeConfig | None, tuple[int, ...] | None]:
    """vLLM's `speculative_config` dict -> (SpeculativeConfig for ngram/draft_model, layer ids for extraction).

    At most one is not None: extract_hidden_states gives layer ids (None = default), the others a SpeculativeConfig.
    vLLM keys that change nothing hsx computes are accepted with one warning naming them.
    """
    if spec is None:
        return None, None
    if not isinstance(spec, Mapping):
        raise TypeError(f"speculative_config must be a dict, got {type(spec).__name__}")
    method = spec.get("method")
    if method is None:
        if not spec.get("model"):
            raise ValueError(f"speculative_config {dict(spec)!r} has no 'method' and no draft 'model' to infer it from; "
                             f"set 'method' to one of {', '.join(speculation_methods())} (or {SPECULATIVE_METHOD} for "
                             "extraction)")
        model = str(spec["model"])
        if not os.path.isdir(model):
            raise ValueError(f"draft model {model!r} does not exist or is not a folder; pass a local folder holding "
                             "the draft (hub ids are not fetched for drafts), or set 'method'")
        method = checkpoint_method(model)
        if method is None:
            raise ValueError(f"speculative_config has no 'method' and {model} holds {_describe_checkpoint(None)}; set "
                             f"'method' to one of {', '.join(speculation_methods())}")
        spec = {**spec, "method": method}
        logger.info("speculative method %r inferred from %s", method, model)
    if method != SPECULATIVE_METHOD and method in drafter_methods() and "num_speculative_tokens" not in spec and spec.get("model") and \
            os.path.isdir(str(spec["model"])):
        k = checkpoint_num_speculative_tokens(str(spec["model"]))
        if k is not None:
            spec = {**spec, "num_speculative_tokens": k}
    if method == SPECULATIVE_METHOD or method not in speculation_methods():
        return None, layer_ids_from_speculative_config(spec)
    known = _SPEC_KEYS.get(method, _DRAFTER_KEYS)
    if "num_speculative_tokens" not in spec:
        raise ValueError(f"speculative_config for method {method!r} needs num_speculative_tokens (k >= 1), e.g. 3")
    ignored = {}
    for key, value in spec.items():
        if key in known:
            continue
        if key not in _SPEC_IGNORED:
            raise ValueError(f"unknown speculative_config keys {sorted(set(spec) - set(known) - set(_SPEC_IGNORED))} "
                             f"for method {method!r}; valid: {sorted(known)} (accepted and ignored: "
                             f"{sorted(_SPEC_IGNORED)})")
        honoured = _SPEC_IGNORED[key]
        if honoured is not None and value is not None and value != honoured:
            raise ValueError(f"speculative_config {key}={value!r} is not supported by hsx; only {key}={honoured!r} "
                             "(remove the key or set it so)")
        ignored[key] = value
    if ignored:
        logger.warning("speculative_config keys %s have no effect in hsx and are ignored", sorted(ignored))
    return SpeculativeConfig(**{k: spec[k] for k in known if k in spec}), None


def layer_ids_from_speculative_config(spec: Mapping[str, Any] | None) -> tuple[int, ...] | None:
    """Validate vLLM's `speculative_config` for hidden-state extraction and return its layer ids (None = default)."""
    if spec is None:
        return None
    if not isinstance(spec, Mapping):
        raise TypeError(f"speculative_config must be a dict, got {type(spec).__name__}")
    method = spec.get("method")
    if method != SPECULATIVE_METHOD:
        raise ValueError(f"speculative_config method {method!r} is not supported; hsx supports only "
                         f"{{'method': '{SPECULATIVE_METHOD}', 'num_speculative_tokens': 1}} for extraction and "
                         f"the speculative decoding methods {', '.join(speculation_methods())}")
    n = spec.get("num_speculative_tokens", 1)
    if n != 1:
        raise ValueError(f"num_speculative_tokens={n!r}; the {SPECULATIVE_METHOD} method requires exactly 1")
    known = {"method", "num_speculative_tokens", "draft_model_config", "model"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"unknown speculative_config keys {unknown}; hsx reads {sorted(known)}")
    draft = spec.get("draft_model_config") or {}
    hf_config = draft.get("hf_config") or {} if isinstance(draft, Mapping) else {}
    ids = hf_config.get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else tuple(ids)
