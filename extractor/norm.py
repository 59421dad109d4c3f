"""The target model's final norm, for turning a stored pre-norm last layer into the post-norm state.

    FinalNorm.from_model_dir(dir)   only the final norm's weights, read from a local safetensors checkpoint
                                    (model.safetensors or an index.json + shards), loaded into transformers' own
                                    norm module of that model type (LlamaRMSNorm, Qwen3RMSNorm, ..., torch's
                                    LayerNorm for GPT-2)
    FinalNorm.of_model(model)       the loaded model's own final norm module (no copy): what an engine that holds the
                                    target hands a drafter, so nothing is read from its folder again
    norm(x)                         [..., H] -> [..., H], exactly what the model's own `model.norm` computes
    norm.to(dtype)                  the same norm with its weights in `dtype` (as an engine running in it has them)

Computing with transformers' module, not a copy of its formula, keeps the result bit-identical to the model's own
forward as transformers changes. Only families whose final norm has been checked against the model are accepted
(SUPPORTED_MODEL_TYPES); others are refused with the way round (extract with the last layer normalised, or apply
the norm in the trainer).
"""

from __future__ import annotations

import copy
import importlib
import json
import os
from dataclasses import dataclass

import torch

from extractor.facts import text_config

SUPPORTED_MODEL_TYPES = {
    "llama": "rms", "mistral": "rms", "mixtral": "rms", "qwen2": "rms", "qwen2_moe": "rms", "qwen3": "rms",
    "qwen3_moe": "rms", "gpt2": "layer",
}
"""model_type -> the kind of its final norm: "rms" (transformers' `<Model>RMSNorm`) or "layer" (torch LayerNorm).
Gemma-style (1 + weight) norms are deliberately absent."""

NORM_KEYS = {
    "rms": ("model.norm.weight", "norm.weight", "model.language_model.norm.weight"),
    "layer": ("transformer.ln_f.weight", "ln_f.weight"),
}
"""Checkpoint names of the final norm's weight, tried in order."""


@dataclass(frozen=True)
class FinalNorm:
    """A model's final norm: transformers' own module for its model type, with the checkpoint's weights."""

    model_type: str
    """The config's model_type (of its text config, for a multimodal checkpoint)."""
    module: torch.nn.Module
    """The norm module (e.g. LlamaRMSNorm) in eval mode, weights [H] (and bias [H] for LayerNorm), no grad."""

    @property
    def hidden_size(self) -> int:
        return int(self.module.weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of `x` ([..., H]); the result has the dtype transformers would give."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"final norm has width {self.hidden_size} but the hidden states have {x.shape[-1]}; "
                             "the model folder does not belong to this run")
        with torch.no_grad():
            return self.module(x)

    def to(self, dtype: torch.dtype) -> FinalNorm:
        """The same norm with its weights cast to `dtype`."""
        return FinalNorm(self.model_type, copy.deepcopy(self.module).to(dtype))

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> FinalNorm:
        """The final norm module of a loaded transformers model (shared, not copied); ValueError for a model type
        whose norm hsx has not checked, or a model whose norm is not where its type keeps it."""
        config = text_config(model.config)
        model_type = getattr(config, "model_type", "")
        kind = SUPPORTED_MODEL_TYPES.get(model_type)
        if kind is None:
            raise ValueError(f"hsx knows the final norm of model types {sorted(SUPPORTED_MODEL_TYPES)}, not "
                             f"{model_type!r}")
        names = {name for name, _ in model.named_modules()}
        candidates = [key.removesuffix(".weight") for key in NORM_KEYS[kind]]
        found = next((name for name in candidates if name in names), None)
        if found is None:
            raise ValueError(f"cannot find the final norm of this {model_type} model (looked for {candidates})")
        return cls(model_type, model.get_submodule(found))

    @classmethod
    def from_model_dir(cls, model_dir: str) -> FinalNorm:
        """Load only the final norm's weights from a local transformers checkpoint (config.json + safetensors)."""
        from safetensors import safe_open
        from transformers import AutoConfig

        cfg_path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in {model_dir!r}; pass the target model's local folder as "
                                    "model_dir (hsx never downloads models)")
        with open(cfg_path) as f:
            raw = json.load(f)
        model_type = raw.get("model_type", "")
        nested = model_type not in SUPPORTED_MODEL_TYPES and isinstance(raw.get("text_config"), dict)
        if nested:
            model_type = raw["text_config"].get("model_type", model_type)
        kind = SUPPORTED_MODEL_TYPES.get(model_type)
        if kind is None:
            raise ValueError(f"the final norm of model_type {model_type!r} is not supported (supported: "
                             f"{sorted(SUPPORTED_MODEL_TYPES)}); extract with the last layer normalised, or apply the "
                             "norm in your trainer")
        config = AutoConfig.from_pretrained(model_dir)
        if nested:
            config = config.get_text_config()
        eps_name = "rms_norm_eps" if kind == "rms" else "layer_norm_epsilon"
        eps = getattr(config, eps_name, None)
        if eps is None:
            raise ValueError(f"{cfg_path} has no {eps_name}")
        module = _norm_module(model_type, kind, int(config.hidden_size), float(eps))

        index_path = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(model_dir, "model.safetensors")):
            with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir!r}; the "
                                    "final norm is read from safetensors checkpoints only")
        key = next((k for k in NORM_KEYS[kind] if k in weight_map), None)
        if key is None:
            raise ValueError(f"{model_dir!r} holds none of {list(NORM_KEYS[kind])}; cannot find the final norm")
        with safe_open(os.path.join(model_dir, weight_map[key]), framework="pt") as f:
            state = {"weight": f.get_tensor(key)}  # [H]
            bias_key = key.removesuffix("weight") + "bias"
            if kind == "layer" and bias_key in f.keys():
                state["bias"] = f.get_tensor(bias_key)  # [H]
        expected = {name for name, _ in module.named_parameters()}
        if set(state) != expected:
            raise ValueError(f"{model_dir!r}: the final norm {key!r} has tensors {sorted(state)}, but "
                             f"{type(module).__name__} takes {sorted(expected)}; the checkpoint does not match its "
                             "config")
        try:
            module.load_state_dict(state, assign=True)  # the checkpoint's dtype, as transformers loads it
        except RuntimeError as e:
            raise ValueError(f"{model_dir!r}: the final norm {key!r} does not fit its config (hidden_size "
                             f"{config.hidden_size}): {e}") from e
        return cls(model_type, module.eval().requires_grad_(False))


def _norm_module(model_type: str, kind: str, hidden_size: int, eps: float) -> torch.nn.Module:
    """An untrained instance of the norm class the model's own modelling code uses for its final norm."""
    if kind == "layer":
        return torch.nn.LayerNorm(hidden_size, eps=eps)
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    classes = [getattr(modeling, name) for name in dir(modeling) if name.endswith("RMSNorm")]
    classes = [c for c in classes if isinstance(c, type) and issubclass(c, torch.nn.Module)
               and c.__module__ == modeling.__name__]
    if len(classes) != 1:
        raise ValueError(f"transformers' {modeling.__name__} defines {[c.__name__ for c in classes]} RMSNorm "
                         "classes, not one; this transformers version is not supported for the final norm")
    return classes[0](hidden_size, eps=eps)
