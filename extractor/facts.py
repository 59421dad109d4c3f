"""What the engine knows of a target model from its config alone (no weights): the one place the file spec and the
limits are derived, for the runner, `hsx run`'s planning, `hsx estimate` and `hsx serve` alike.

    target_facts(hf_config, model=, revision=, layer_ids=, dtype=, max_model_len=, layers_flag=, target=)
        -> TargetFacts: N, H and the limit read from the text config (as multimodal wrappers keep them), layer ids
        checked against the model (default EAGLE-3's [2, N//2, N-3, N]; a top-k target stands for N, which is then
        captured but not stored), dtype resolved by the engine's "auto" rule, max_model_len = the given one (at most
        the model's max_position_embeddings) or max_position_embeddings or 2048
    TargetFacts.file_spec()   the HiddenStatesSpec every file of this model carries
    TargetFacts.capture_layer_ids   what the engine captures: the stored ids, plus N for a top-k target
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from connectors.format import MODEL, HiddenStatesSpec, LayerIds, check_layer_ids, check_target, target_top_k
from extractor.config import resolve_dtype
from extractor.layers import default_layer_ids
from extractor.media import is_multimodal

DEFAULT_MAX_MODEL_LEN = 2048
"""The length limit of a model whose config gives none."""


@dataclass(frozen=True)
class TargetFacts:
    model: str
    revision: str
    """Commit hash or revision when known ("" for local folders)."""
    architecture: str
    num_hidden_layers: int
    hidden_size: int
    layer_ids: tuple[int, ...]
    dtype: str
    """Resolved torch dtype name (never "auto")."""
    max_model_len: int
    multimodal: bool = False
    """A vision-language target hsx runs with its vision tower (extractor.media.is_multimodal): prompts may bring
    images."""
    target: str = ""
    """"" (the states) or "top_k:K" (connectors.format.check_target): then `layer_ids` lacks N, which the engine
    still captures to compute the top-K log-probabilities from."""

    @property
    def top_k(self) -> int | None:
        return target_top_k(self.target)

    @property
    def capture_layer_ids(self) -> LayerIds:
        """The ids the engine captures: the stored ones, and last N for a top-k target (split off before storing)."""
        if self.top_k is None:
            return self.layer_ids
        return LayerIds((*self.layer_ids, self.num_hidden_layers), self.num_hidden_layers)

    def file_spec(self, storage_dtype: str = MODEL) -> HiddenStatesSpec:
        """The spec of this model's files; `storage_dtype` as the connector stores them (MODEL = the model dtype)."""
        return HiddenStatesSpec(layer_ids=self.layer_ids, num_hidden_layers=self.num_hidden_layers,
                                hidden_size=self.hidden_size, dtype=self.dtype, model=self.model,
                                model_revision=self.revision, last_layer_normalized=False,
                                extra={"architecture": self.architecture}, storage_dtype=storage_dtype,
                                target=self.target)


def text_config(hf_config: Any) -> Any:
    """The config that holds the decoder's sizes: a multimodal wrapper's text config, else the config itself."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def check_runnable(hf_config: Any, model: str) -> None:
    """ValueError (one line) for a target hsx's engine cannot build: no causal LM class in transformers for its config
    (a LLaVA-style wrapper, say; registered and auto_map classes count) and not one of the vision-language families
    hsx runs itself. `--engine vllm` runs what vLLM runs and is not asked."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from extractor.media import SUPPORTED_VL

    auto_map = getattr(hf_config, "auto_map", None) or {}
    if is_multimodal(hf_config) or type(hf_config) in MODEL_FOR_CAUSAL_LM_MAPPING or "AutoModelForCausalLM" in auto_map:
        return
    kind = getattr(hf_config, "model_type", "") or "model of unknown type"
    raise ValueError(f"{model} is a {kind} target, for which transformers has no causal LM class and hsx's engine has "
                     f"no vision-language path; hsx's engine runs decoder-only causal LMs (the families in "
                     f"docs/families.md) and the vision-language families {', '.join(SUPPORTED_VL)} (or give the "
                     "folder of its text model alone; --engine vllm runs what vLLM runs)")


def target_facts(hf_config: Any, *, model: str, revision: str | None = None, layer_ids=None, dtype: str = "auto",
                 max_model_len: int | None = None, layers_flag: str = "layer_ids", target: str = "",
                 target_flag: str = "target") -> TargetFacts:
    """The facts of the model whose transformers config is `hf_config`; ValueError naming `layers_flag`,
    `target_flag` or max_model_len when the settings do not fit the model."""
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(f"{model} is an encoder-decoder model; hsx extracts from decoder-only causal LMs")
    text = text_config(hf_config)
    n, h = int(text.num_hidden_layers), int(text.hidden_size)  # a multimodal wrapper keeps them in its text config
    ids = check_layer_ids(layer_ids if layer_ids else default_layer_ids(n), n, name=f"{layers_flag} (for {model})")
    target = check_target(target, flag=target_flag)
    k = target_top_k(target)
    if k is not None:
        if n in ids:  # the top-k target stands for the last layer: captured, converted, not stored
            ids = LayerIds([i for i in ids if i != n], n)
        if not ids:
            raise ValueError(f"{target_flag} {target} replaces layer {n} (the last) and {layers_flag} lists no other "
                             f"layer to store; give aux layers too, e.g. {layers_flag} "
                             f"{','.join(map(str, default_layer_ids(n)))}")
        vocab = getattr(text, "vocab_size", None)
        if vocab and k > int(vocab):
            raise ValueError(f"{target_flag} {target}: K={k} is more than {model}'s vocabulary of {vocab} tokens; "
                             f"use K <= {vocab}")
    positions = getattr(text, "max_position_embeddings", None)
    if max_model_len and positions and max_model_len > positions:
        raise ValueError(f"max_model_len={max_model_len} is more than {model} was built for (max_position_embeddings="
                         f"{positions}): positions past it are untrained and outputs degrade silently; use "
                         f"max_model_len <= {positions} (or leave it unset)")
    return TargetFacts(model=model, revision=str(getattr(hf_config, "_commit_hash", None) or revision or ""),
                       architecture=",".join(getattr(hf_config, "architectures", None) or []),
                       num_hidden_layers=n, hidden_size=h, layer_ids=ids, dtype=resolve_dtype(dtype, hf_config),
                       max_model_len=int(max_model_len or positions or DEFAULT_MAX_MODEL_LEN), target=target,
                       multimodal=is_multimodal(hf_config))
