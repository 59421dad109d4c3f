"""`EngineOptions`: the settings of the target model, its engine and the output, as every command that runs a model
(`hsx run`, `estimate`, `submit`, `serve`) takes them — one set of fields, docstrings and checks that JobConfig and
ServeConfig extend. A field `max_model_len` is the flag `--max-model-len` (`flag`), and an error of the engine's or
the connector's own config names that flag (`flag_errors`).

    EngineOptions(...)                  checked once, here: the layer ids (carried typed after it, as
                                        connectors.format.LayerIds), dtype, storage options, lengths; then the
                                        engine's and the connector's own configs are built once to check the rest
    options.engine_config(**resolved)   the extractor.EngineConfig a worker or replica builds its engine from
    options.connector_config()          the connector's HiddenStatesConnectorConfig for --output
    options.media_policy()              the extractor.media.MediaPolicy of the media flags (part of engine_config)
    flag(name) / flag_errors(options, cls, **kwargs)
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

from connectors.format import check_layer_ids, check_storage_dtype, check_target
from connectors.storage import parse_storage_options
from extractor.config import EngineConfig, canonical_dtype
from extractor.media import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_REQUEST_IMAGE_BYTES, MediaPolicy


def flag(name: str) -> str:
    """The CLI flag of a config field: max_model_len -> --max-model-len."""
    return "--" + name.replace("_", "-")


# engine / connector argument -> the options field (flag) that sets it, where the names differ
_FLAG_OF = {"layer_ids": "layers", "eagle_aux_hidden_state_layer_ids": "layers", "shared_storage_path": "output"}


def flag_errors(options: Any, cls: type, **kwargs: Any) -> Any:
    """cls(**kwargs), with the argument names in its errors rewritten as the flags of `options` that set them."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        names = {f.name for f in dataclasses.fields(options)} | set(_FLAG_OF)
        # argument names: the message's first word, and any snake_case name in it ("top_k must be ...")
        pattern = r"(?<![\w-])(" + "|".join(sorted(names, key=len, reverse=True)) + r")(?![\w-])"
        text = re.sub(r"kv_connector_extra_config\[['\"](\w+)['\"]\]", r"\1", str(e))
        text = re.sub(pattern, lambda m: flag(_FLAG_OF.get(m.group(1), m.group(1)))
                      if "_" in m.group(1) or m.start() == 0 else m.group(1), text)
        raise ValueError(text) from e


@dataclass(frozen=True)
class EngineOptions:
    """The target model, how its engine runs, and where the files go."""

    model: str = ""
    """Target model: a local folder (config, weights, tokenizer) or a hub id already in the local cache."""
    output: str = ""
    """Where files go: a local folder or fsspec URL (s3://bucket/prefix)."""
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
    """Longest sequence in tokens (prompt + generated); default the model's max_position_embeddings."""
    max_num_batched_tokens: int | None = None
    """Token budget of one forward pass; longer batches are split. Default the engine's (8192)."""
    packing: str = "auto"
    """Prompt-only batches: auto packs prompts end to end without padding where that is exact for the target (else
    pads), on refuses a target that cannot be packed, off always pads."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for --output, as JSON (e.g. {"client_kwargs": {"endpoint_url": ...}})."""
    storage_dtype: str = "model"
    """How hidden states are stored: model (the model dtype), bfloat16, float16, float32, or fp8 (float8_e4m3fn with
    a float32 scale per token and layer: about half of bf16's bytes). Readers give back the model dtype."""
    target: str = "states"
    """What is kept of the last layer N: states (its hidden state, when --layers lists it), or top_k:K (the target's
    K most likely next tokens and their log-probabilities in its place, all EAGLE-3 training reads of it: 64 tokens
    cost 512 bytes a token against 2H for a bf16 layer; N is captured but not stored)."""

    limit_mm_per_prompt: dict[str, int] | None = None
    """Most images one prompt may bring (a vision-language target), as JSON {"image": N}; default vLLM's 999."""
    allowed_local_media_path: str | None = None
    """The folder local images (paths, file:// URLs) must lie in; unset: local images are refused (vLLM's rule)."""
    allow_media_fetch: bool = False
    """Fetch http(s) image URLs; off: such images are refused (download them, give local paths)."""
    allowed_media_domains: tuple[str, ...] | None = field(default=None, metadata={"cli": {"nargs": "+",
                                                                                         "metavar": "HOST"}})
    """vLLM's: the only hosts image URLs are fetched from (matched exactly), space-separated; redirects are followed
    only to these hosts. Unset: any host (with --allow-media-fetch), and no redirect is followed."""
    image_fetch_timeout_s: float | None = None
    """The whole fetch of one image URL (connect, redirects, retries, body), in seconds; default
    $VLLM_IMAGE_FETCH_TIMEOUT, else 30."""
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    """One image's decoded RGB bytes (width x height x 3; 256 MiB, PIL's 89.5 Mpixel bound), read from its header:
    a larger image is refused before it is decoded."""
    max_request_image_bytes: int = DEFAULT_MAX_REQUEST_IMAGE_BYTES
    """A prompt's images' decoded RGB bytes together (512 MiB)."""
    mm_embeds: bool = False
    """Also store an image prompt's merged input embeddings at its image tokens (mm_embeds [N, H]), what vLLM's
    EAGLE proposer feeds a drafter there."""

    def __post_init__(self) -> None:
        if self.layers is not None:
            object.__setattr__(self, "layers", check_layer_ids(self.layers, name="--layers"))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, flag="--dtype"))
        object.__setattr__(self, "storage_options", parse_storage_options(self.storage_options, "--storage-options"))
        object.__setattr__(self, "storage_dtype", check_storage_dtype(self.storage_dtype, flag="--storage-dtype"))
        object.__setattr__(self, "target", check_target(self.target, flag="--target") or "states")
        if isinstance(self.limit_mm_per_prompt, str):  # the flag's JSON
            try:
                object.__setattr__(self, "limit_mm_per_prompt", json.loads(self.limit_mm_per_prompt))
            except json.JSONDecodeError:
                raise ValueError(f"--limit-mm-per-prompt must be JSON like '{{\"image\": 2}}', got "
                                 f"{self.limit_mm_per_prompt!r}") from None
        if isinstance(self.allowed_media_domains, str):  # a config file's "a.example,b.example"
            object.__setattr__(self, "allowed_media_domains",
                               tuple(d.strip() for d in self.allowed_media_domains.split(",") if d.strip()))
        if isinstance(self.allowed_media_domains, list):  # a config file's list
            object.__setattr__(self, "allowed_media_domains", tuple(self.allowed_media_domains))
        for name in ("max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{flag(name)} must be a positive integer, got {value!r}")

    def check_engine(self) -> None:
        """Build the engine's and the connector's own configs once (what a subclass's __post_init__ calls last, after
        its own fields are checked): their checks, with errors naming these flags."""
        if self.model:
            self.engine_config()
        if self.output:
            self.connector_config()

    def engine_config(self, *, model: str | None = None, layer_ids: tuple[int, ...] | None = None,
                      dtype: str | None = None, max_model_len: int | None = None, device: str | None = None,
                      **engine: Any) -> EngineConfig:
        """The engine's EngineConfig; the keyword arguments override with values resolved from the model's config
        (so every worker runs exactly what run.json records), `engine` adds EngineConfig fields of a command's own
        (e.g. serve's max_num_seqs)."""
        if self.max_num_batched_tokens is not None:
            engine.setdefault("max_num_batched_tokens", self.max_num_batched_tokens)
        return flag_errors(self, EngineConfig, model=model or self.model, layer_ids=layer_ids or self.layers,
                           dtype=dtype or self.dtype, max_model_len=max_model_len or self.max_model_len,
                           device=device, attn_implementation=self.attn_implementation, revision=self.revision,
                           trust_remote_code=self.trust_remote_code, target=self.engine_target,
                           packing=self.packing, media=self.media_policy(), **engine)

    def media_policy(self) -> MediaPolicy:
        """What image prompts may bring (extractor.media), from the media flags."""
        return flag_errors(self, MediaPolicy, limit_mm_per_prompt=self.limit_mm_per_prompt,
                           allowed_local_media_path=self.allowed_local_media_path, allow_fetch=self.allow_media_fetch,
                           allowed_media_domains=self.allowed_media_domains,
                           image_fetch_timeout_s=self.image_fetch_timeout_s, max_image_bytes=self.max_image_bytes,
                           max_request_image_bytes=self.max_request_image_bytes)

    @property
    def engine_target(self) -> str:
        """--target as the engine and the file spec take it ("" for states)."""
        return check_target(self.target)

    def connector_settings(self) -> dict[str, Any]:
        """kv_connector_extra_config of the connector writing to --output (custom paths honoured under it)."""
        return {"shared_storage_path": self.output, "allow_custom_save_path": True,
                "storage_options": dict(self.storage_options), "storage_dtype": self.storage_dtype,
                "mm_embeds": self.mm_embeds}

    def connector_config(self):
        """The hidden-states connector's settings for --output."""
        from connectors.extra_config import HiddenStatesConnectorConfig

        return flag_errors(self, HiddenStatesConnectorConfig, **self.connector_settings())
