"""The target model's final norm, for turning a stored pre-norm last layer into the post-norm state.

    FinalNorm.of_model(model)       the loaded model's own final norm module (no copy): what an engine that holds the
                                    target hands a drafter, so nothing is read from its folder again
    FinalNorm.from_model_dir(dir)   the same module, built from the folder's config on the meta device (no weights
                                    allocated) and given only the final norm's tensors from its safetensors checkpoint
                                    (model.safetensors or an index.json + shards, read by extractor.checkpoint_files)
    norm(x)                         [..., H] -> [..., H], exactly what the model's own final norm computes
    norm.to(dtype)                  the same norm with its weights in `dtype` (as an engine running in it has them)

The norm is found by structure, as the decoder layers are (extractor.layers.find_decoder): the one norm module
(RMSNorm, LayerNorm, ... of any family) among the children of the module that holds the decoder layers. Computing with
the model's own module, not a copy of its formula, keeps the result bit-identical to the model's forward: Gemma's
(1 + w) RMSNorm, GPT-2's LayerNorm with bias, OLMo-2's and Falcon-H1's norms alike. A model whose decoder holder has
no single norm child is refused with the way round (extract with the last layer normalised, or apply the norm in the
trainer).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch

from extractor.checkpoint_files import load_tensors, weight_map
from extractor.facts import text_config
from extractor.layers import find_decoder
from extractor.media import is_multimodal

_BEYOND_THE_DECODER = ("mtp", "vision", "visual", "audio", "multi_modal_projector", "layers.")
"""Parts of a checkpoint key that put a norm outside the text decoder's final norm (MTP heads, encoders, layers)."""


def final_norm_name(model: torch.nn.Module) -> str:
    """The qualified module name of a transformers causal LM's final norm (e.g. "model.norm", "transformer.ln_f",
    "backbone.norm_f"): the one norm among the children of the module that holds the decoder layers."""
    config = text_config(model.config)
    owner_name, owner, layers = find_decoder(model, int(config.num_hidden_layers))
    children = list(owner.named_children())
    after = [i for i, (_, child) in enumerate(children) if child is layers][0]
    norms = [name for name, child in children if child is not layers and _is_norm(child)]
    if len(norms) > 1:  # e.g. Bloom's word_embeddings_layernorm before its layers: the final one comes after them
        norms = [name for name, child in children[after + 1:] if _is_norm(child)]
    if len(norms) != 1:
        raise ValueError(f"cannot find the final norm of this {getattr(config, 'model_type', '?')} model: the module "
                         f"that holds its decoder layers ({owner_name or 'the model'}, {type(owner).__name__}) has "
                         f"{'no' if not norms else len(norms)} norm modules among its children {norms or ''}; extract "
                         "with the last layer normalised, or apply the norm in your trainer")
    return f"{owner_name}.{norms[0]}" if owner_name else norms[0]


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or type(module).__name__.endswith("Norm")


@dataclass(frozen=True)
class FinalNorm:
    """A model's final norm: the model's own norm module, with the checkpoint's weights."""

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
        """The final norm module of a loaded transformers model (shared, not copied); ValueError when the model has
        no single final norm beside its decoder layers."""
        model_type = getattr(text_config(model.config), "model_type", "")
        return cls(model_type, model.get_submodule(final_norm_name(model)))

    @classmethod
    def from_model_dir(cls, model_dir: str) -> FinalNorm:
        """Load only the final norm's weights from a local transformers checkpoint (config.json + safetensors)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg_path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in {model_dir!r}; pass the target model's local folder as "
                                    "model_dir (hsx never downloads models)")
        try:
            full = AutoConfig.from_pretrained(model_dir)
            config = text_config(full)
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f"{cfg_path}: transformers cannot read this config ({e}); the final norm is found in "
                             "the model transformers builds from it") from None
        model_type = getattr(config, "model_type", "")
        try:
            with torch.device("meta"):  # the modules only: no weights allocated, nothing initialised
                if is_multimodal(full):  # a vision-language target: its text model's norm, under its own names
                    from transformers import AutoModelForImageTextToText

                    skeleton = AutoModelForImageTextToText.from_config(full)
                else:
                    skeleton = AutoModelForCausalLM.from_config(config)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{model_dir!r}: transformers cannot build a causal LM of model_type {model_type!r} "
                             f"({e}); extract with the last layer normalised, or apply the norm in your trainer"
                             ) from None
        name = final_norm_name(skeleton)
        module = copy.deepcopy(skeleton.get_submodule(name))
        del skeleton
        files = weight_map(model_dir, "the final norm is read")
        keys = {param: _checkpoint_key(f"{name}.{param}", files, model_dir) for param, _ in module.named_parameters()}
        loaded = load_tensors(model_dir, keys.values(), files=files)
        tensors = {param: loaded[key] for param, key in keys.items()}  # [H] each
        try:
            module.load_state_dict(tensors, strict=False, assign=True)  # the checkpoint's dtype, as transformers
        except RuntimeError as e:
            raise ValueError(f"{model_dir!r}: the final norm {name!r} does not fit its config (hidden_size "
                             f"{config.hidden_size}): {e}") from e
        meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if meta:
            raise ValueError(f"{model_dir!r}: the final norm {name!r} ({type(module).__name__}) keeps {meta} outside "
                             "its parameters; hsx cannot rebuild it from the checkpoint alone")
        return cls(model_type, module.eval().requires_grad_(False))


def _checkpoint_key(name: str, files: dict[str, str], model_dir: str) -> str:
    """The checkpoint's key for the module tensor `name` ("model.norm.weight"): itself, or the one key ending with its
    last two parts outside MTP heads, encoders and layers (a multimodal checkpoint's "model.language_model.norm.weight"
    for a text model's "model.norm.weight")."""
    if name in files:
        return name
    tail = ".".join(name.split(".")[-2:])
    keys = [k for k in files if (k == tail or k.endswith("." + tail))
            and not any(part in k for part in _BEYOND_THE_DECODER)]
    keys = [k for k in keys if "language_model" in k] or keys
    if len(keys) != 1:
        raise ValueError(f"{model_dir!r}: cannot find the final norm's tensor {name!r} in the checkpoint "
                         f"({'candidates: ' + str(keys) if keys else 'no key ends with ' + repr(tail)})")
    return keys[0]
