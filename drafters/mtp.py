"""MTP: the target's own multi-token-prediction layers as its drafter (vLLM's `method: "mtp"`).

Many targets ship MTP layers in their checkpoint beside the decoder (DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5);
transformers drops them at load (`_keys_to_ignore_on_load_unexpected`), so hsx reads those tensors from the
checkpoint's safetensors itself and builds each MTP layer from the target family's own transformers decoder layer.

    MtpStyle            one checkpoint layout: where the tensors are, which norm the carried state gets
    STYLES              model_type -> MtpStyle (deepseek_v3, glm4_moe, qwen3_next, qwen3_5 / qwen3_5_text)
    mtp_style(config)   the style and number of MTP layers a config.json declares (None: it declares none)
    MtpHead             the MTP layers of one target, loaded from a folder (the target's own, a copy of it with tuned
                        layers, or a standalone `hsx train-drafter --kind mtp` checkpoint):
        decode(ids, hidden, positions, mask, cache) -> [R, S, L, H]   every MTP layer over the same entries
        logits(carried, j)                                            MTP layer j's logits over its carried state
    FAMILY              MTP in the drafter registry (its proposer: drafters/mtp_proposer.py)

What each style computes for entry p (token x_{p+1} beside the state h_p of x_p; p is the entry's position), with the
vLLM file it follows:

    deepseek_v3  (deepseek_mtp.py; layers model.layers.{N+j}.*, N = num_hidden_layers, num_nextn_predict_layers of them)
        e = embed(x_{p+1}), zero where p == 0;  u = eh_proj([enorm(e) ; hnorm(h_p)]);  v = decoder layer (u) (its
        residual included, no final norm);  carried = shared_head.norm(v);  logits = shared_head.head(carried)
    glm4_moe     (glm4_moe_mtp.py; the same tensors) as deepseek_v3, but the carried state is v itself (pre-norm):
        logits = shared_head.head(shared_head.norm(v)) — vLLM's Glm4MoeMTP returns one state where DeepSeekMTP
        returns two, the difference behind vLLM #46075
    qwen3_next   (qwen3_next_mtp.py; mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm shared by the
    qwen3_5      qwen3_5_mtp.py;   layers mtp.layers.{j}.*, each a full-attention decoder layer)
        u = fc([pre_fc_norm_embedding(e) ; pre_fc_norm_hidden(h_p)]);  v = layers[j](u);  carried = norm(v);
        logits = lm_head(carried) (the target's); no zeroing at position 0

h_p of the first draft step is the target's last layer after its final norm (what vLLM's target model returns; hsx
captures layer N pre-norm and applies the target's norm). The norms are the target family's own RMSNorm class
(DeepSeek/GLM: x * w; Qwen3-Next/3.5: x * (1 + w)), as vLLM builds them. Embeddings: an MTP layer's own
embed_tokens / shared_head.head when the checkpoint holds them (DeepSeek-V3 ships copies), else the target's.

Chaining (k > L): draft step s reads MTP layer s % L, as vLLM's `spec_step_idx % num_mtp_layers`. Unlike vLLM, whose
layers j >= 1 attend over KV slots only they wrote (holes for L > 1), every MTP layer here is fed every entry (the
verified ones and each draft), so each has a full cache: the same drafts as vLLM for L = 1, the case of every
shipped checkpoint hsx knows (vLLM's qwen3_next_mtp.py also always runs layer 0; for L = 1 that is the same).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from drafters.features import Features
from drafters.llama_layers import cache_kwarg

WEIGHTS_NAME = "model.safetensors"


@dataclass(frozen=True)
class MtpStyle:
    name: str
    """The model_type family it follows (and the vLLM file named in the module docstring)."""
    count_keys: tuple[str, ...]
    """config keys giving the number of MTP layers, first present wins."""
    default_count: int
    """The count when none of count_keys is in the config (vLLM's default)."""
    shared_parts: bool
    """True: one fc / input norms / output norm for all layers (Qwen: mtp.*), False: each layer its own (DeepSeek)."""
    carry_normed: bool
    """Whether the state carried to the next step is the output norm's (DeepSeek, Qwen) or the pre-norm one (GLM)."""
    zero_first: bool
    """Whether the embedding is zeroed at position 0 (DeepSeek, GLM)."""

    def parts_prefix(self, num_hidden_layers: int, j: int) -> str:
        return "mtp." if self.shared_parts else f"model.layers.{num_hidden_layers + j}."

    def block_prefix(self, num_hidden_layers: int, j: int) -> str:
        return f"mtp.layers.{j}." if self.shared_parts else f"model.layers.{num_hidden_layers + j}."

    @property
    def part_keys(self) -> dict[str, str]:
        """hsx's name of each non-block tensor -> its name after the parts prefix."""
        if self.shared_parts:
            return {"norm_e.weight": "pre_fc_norm_embedding.weight", "norm_h.weight": "pre_fc_norm_hidden.weight",
                    "proj.weight": "fc.weight", "out_norm.weight": "norm.weight"}
        return {"norm_e.weight": "enorm.weight", "norm_h.weight": "hnorm.weight", "proj.weight": "eh_proj.weight",
                "out_norm.weight": "shared_head.norm.weight"}

    @property
    def optional_keys(self) -> dict[str, str]:
        """Per-layer copies of the shared embedding and lm_head a checkpoint may hold (DeepSeek-V3 does)."""
        return {} if self.shared_parts else {"embed": "embed_tokens.weight", "head": "shared_head.head.weight"}


_DEEPSEEK = MtpStyle("deepseek_v3", ("num_nextn_predict_layers",), 0, shared_parts=False, carry_normed=True,
                     zero_first=True)
_GLM = MtpStyle("glm4_moe", ("num_nextn_predict_layers",), 0, shared_parts=False, carry_normed=False,
                zero_first=True)
_QWEN_NEXT = MtpStyle("qwen3_next", ("num_nextn_predict_layers", "mtp_num_hidden_layers"), 1, shared_parts=True,
                      carry_normed=True, zero_first=False)
_QWEN_3_5 = MtpStyle("qwen3_5", ("mtp_num_hidden_layers", "num_nextn_predict_layers"), 1, shared_parts=True,
                     carry_normed=True, zero_first=False)
STYLES: dict[str, MtpStyle] = {"deepseek_v3": _DEEPSEEK, "glm4_moe": _GLM, "qwen3_next": _QWEN_NEXT,
                               "qwen3_5_text": _QWEN_3_5, "qwen3_5": _QWEN_3_5, "qwen3_5_moe_text": _QWEN_3_5,
                               "qwen3_5_moe": _QWEN_3_5}
"""model_type -> style. A multimodal Qwen3.5 config's text part decides (its text_config)."""


def _text_config_dict(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) and text.get("model_type") else config


def mtp_style(config: Mapping[str, Any]) -> tuple[MtpStyle, int] | None:
    """(style, number of MTP layers) a config.json declares; None when its model_type has no MTP layout hsx knows or
    it declares 0 layers. A Qwen style without a count key declares vLLM's default (1): whether the tensors exist is
    checked when they are read."""
    outer = config.get("model_type")
    text = _text_config_dict(config)
    style = STYLES.get(str(text.get("model_type"))) or STYLES.get(str(outer))
    if style is None:
        return None
    count = next((text[k] for k in style.count_keys if k in text), None)
    if count is None:
        count = next((config[k] for k in style.count_keys if k in config), style.default_count)
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return None
    return style, count


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{os.path.dirname(path)} has no config.json; method 'mtp' reads a target folder with MTP "
                         "layers (or a `hsx train-drafter --kind mtp` checkpoint)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{path} is not a JSON object")
    return doc


class _Parts(nn.Module):
    """One MTP layer's input norms, projection and output norm (shared by all layers in the Qwen style)."""

    def __init__(self, norm_cls: type, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm_e = norm_cls(hidden_size, eps=eps)
        self.norm_h = norm_cls(hidden_size, eps=eps)
        self.proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.out_norm = norm_cls(hidden_size, eps=eps)


def _skeleton(hf_config):
    """The target's modules on the meta device: its decoder layer class, rotary class and norm class."""
    from transformers import AutoModelForCausalLM

    from extractor.layers import find_decoder
    from extractor.norm import final_norm_name

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    _, holder, layers = find_decoder(model, int(hf_config.num_hidden_layers))
    rotary = next((m for name, m in holder.named_children() if "rotary" in name), None)
    return type(layers[0]), (type(rotary) if rotary is not None else None), \
        type(model.get_submodule(final_norm_name(model)))


def _block_config(hf_config, style: MtpStyle, count: int):
    """The config MTP decoder layers are built from: sdpa attention (the proposer's boolean masks), full attention
    at every index an MTP layer is built with."""
    config = copy.deepcopy(hf_config)
    config._attn_implementation = "sdpa"
    if getattr(config, "layer_types", None) is not None:  # hybrids (Qwen3-Next): MTP layers attend in full
        config.layer_types = ["full_attention"] * (int(config.num_hidden_layers) + count)
    return config


class MtpHead(nn.Module):
    """The MTP layers of one target (see the module docstring). Its tensors stay in the checkpoint's key names
    (checkpoint_keys()), so a tuned copy is written back into a target folder unchanged in layout."""

    def __init__(self, hf_config, style: MtpStyle, count: int, embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                 optional: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.style, self.count = style, int(count)
        self.hf_config = hf_config
        self.num_hidden_layers = int(hf_config.num_hidden_layers)
        h = int(hf_config.hidden_size)
        eps = float(getattr(hf_config, "rms_norm_eps", 1e-6))
        layer_cls, rotary_cls, norm_cls = _skeleton(hf_config)
        config = _block_config(hf_config, style, count)
        self.parts = nn.ModuleList([_Parts(norm_cls, h, eps) for _ in range(1 if style.shared_parts else count)])
        blocks = []
        for j in range(count):
            block = layer_cls(config, j if style.shared_parts else self.num_hidden_layers + j)
            attention = getattr(block, "self_attn", None)
            if attention is not None and hasattr(attention, "layer_idx"):
                attention.layer_idx = j  # the proposer's cache holds MTP layer j at index j
            blocks.append(block)
        self.blocks = nn.ModuleList(blocks)
        self.rotary_emb = rotary_cls(config=config) if rotary_cls is not None else None
        # the target's embeddings and lm_head (shared, not copied), unless the checkpoint holds a layer's own
        self.register_buffer("target_embed", embed_tokens.detach(), persistent=False)
        self.register_buffer("target_lm_head", lm_head.detach(), persistent=False)
        self.own = nn.ParameterDict()
        for name in optional:  # "embed{j}" / "head{j}"
            self.own[name] = nn.Parameter(torch.empty_like(embed_tokens if name.startswith("embed") else lm_head),
                                          requires_grad=False)

    # -- names ----------------------------------------------------------------------------------------------------
    def checkpoint_keys(self) -> dict[str, str]:
        """hsx parameter name -> the checkpoint's key, for every parameter of the head."""
        keys = {}
        n = self.num_hidden_layers
        for i in range(len(self.parts)):
            for local, remote in self.style.part_keys.items():
                keys[f"parts.{i}.{local}"] = self.style.parts_prefix(n, i) + remote
        for j, block in enumerate(self.blocks):
            for name, _ in block.named_parameters():
                keys[f"blocks.{j}.{name}"] = self.style.block_prefix(n, j) + name
        for name in self.own:
            kind, j = ("embed", int(name[5:])) if name.startswith("embed") else ("head", int(name[4:]))
            keys[f"own.{name}"] = self.style.parts_prefix(n, j) + self.style.optional_keys[kind]
        return keys

    # -- computing ---------------------------------------------------------------------------------------------
    def _embed(self, j: int) -> torch.Tensor:
        name = f"embed{j}"
        return self.own[name] if name in self.own else self.target_embed

    def _head(self, j: int) -> torch.Tensor:
        name = f"head{j}"
        return self.own[name] if name in self.own else self.target_lm_head

    def layer_forward(self, j: int, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
        """MTP layer j over entries (x_{p+1}, h_p): input_ids [R, S], hidden [R, S, H], position_ids [R, S] ->
        [R, S, H] the carried states."""
        parts = self.parts[j % len(self.parts)]
        embeds = torch.nn.functional.embedding(input_ids, self._embed(j)).to(hidden.dtype)
        if self.style.zero_first:
            embeds = torch.where(position_ids[..., None] == 0, torch.zeros_like(embeds), embeds)
        x = parts.proj(torch.cat([parts.norm_e(embeds), parts.norm_h(hidden)], dim=-1))
        rope = self.rotary_emb(x, position_ids) if self.rotary_emb is not None else None
        out = self.blocks[j](x, attention_mask=attention_mask, position_ids=position_ids, position_embeddings=rope,
                             **cache_kwarg(cache))
        v = out[0] if isinstance(out, tuple) else out
        return parts.out_norm(v) if self.style.carry_normed else v

    def decode(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
        """Every MTP layer over the same entries -> [R, S, L, H] (layer j's carried states at [..., j, :])."""
        return torch.stack([self.layer_forward(j, input_ids, hidden, position_ids, attention_mask, cache)
                            for j in range(self.count)], dim=2)

    def logits(self, carried: torch.Tensor, j: int) -> torch.Tensor:
        """[..., H] MTP layer j's carried state -> [..., V] its logits."""
        x = carried if self.style.carry_normed else self.parts[j % len(self.parts)].out_norm(carried)
        return x @ self._head(j).to(x.dtype).T

    # -- loading -------------------------------------------------------------------------------------------------
    @classmethod
    def from_folder(cls, model_dir: str, *, hf_config, embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> MtpHead:
        """The MTP layers `model_dir` holds (its config.json must declare them: num_nextn_predict_layers /
        mtp_num_hidden_layers), built for the target whose config, embeddings and lm_head are given. ValueError in
        one line for a folder that declares none, lacks a tensor, holds one of the wrong shape or a non-finite
        one."""
        doc = _read_json(os.path.join(model_dir, "config.json"))
        found = mtp_style(doc)
        if found is None:
            kinds = ", ".join(sorted({s.name for s in STYLES.values()}))
            raise ValueError(f"{model_dir} declares no MTP layers (model_type "
                             f"{_text_config_dict(doc).get('model_type')!r}, num_nextn_predict_layers / "
                             f"mtp_num_hidden_layers unset or 0); method 'mtp' needs a target whose checkpoint ships "
                             f"them ({kinds} styles), or another method (e.g. eagle3 with a trained head)")
        style, count = found
        text = _text_config_dict(doc)
        for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
            want = getattr(hf_config, key)
            if key in text and int(text[key]) != int(want):
                raise ValueError(f"{model_dir}: its MTP layers are for a target with {key} {text[key]}, this target "
                                 f"has {want}; use the target's own folder or an MTP checkpoint trained on it")
        weight_map = _weight_map(model_dir)
        n = int(hf_config.num_hidden_layers)
        optional = tuple(f"{kind}{j}" for j in range(count) for kind, suffix in style.optional_keys.items()
                         if style.parts_prefix(n, j) + suffix in weight_map)
        head = cls(hf_config, style, count, embed_tokens, lm_head, optional)
        own = head.state_dict()
        sources = {name: expert_sources(key, tuple(own[name].shape), weight_map)
                   for name, key in head.checkpoint_keys().items()}
        missing = [key for groups in sources.values() for group in groups for key in group if key not in weight_map]
        if missing:
            raise ValueError(f"{model_dir} declares {count} MTP layer(s) ({style.name} style) but its checkpoint lacks "
                             f"{len(missing)} of their tensors, e.g. {missing[:3]}; a target whose MTP weights were "
                             "dropped (e.g. re-saved by transformers) cannot run method 'mtp'")
        state = _read_tensors(model_dir, weight_map, sources)
        for name, tensor in state.items():
            key = head.checkpoint_keys()[name]
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(f"{model_dir}: MTP tensor {key} has shape {tuple(tensor.shape)}, the target's "
                                 f"config makes it {tuple(own[name].shape)}; the MTP layers are not this target's")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{model_dir}: MTP tensor {key} holds non-finite values (NaN or inf); the "
                                 "checkpoint is damaged")
        head.to(dtype or embed_tokens.dtype)
        head.load_state_dict(state, strict=False)
        return head.to(device or embed_tokens.device).eval().requires_grad_(False)


def _weight_map(model_dir: str) -> dict[str, str]:
    from extractor.norm import checkpoint_weight_map

    try:
        return checkpoint_weight_map(model_dir, "MTP layers are read")
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None


_FUSED_EXPERTS = {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}
"""transformers' fused expert tensors [E, ...] -> the per-expert projections checkpoints store (gate_up: gate and
up of expert e concatenated along dim 0, as transformers' WeightConverter for these families)."""


def expert_sources(key: str, shape: tuple[int, ...], weight_map: Mapping[str, str] | None = None
                   ) -> list[list[str]]:
    """The checkpoint keys a module tensor is read from: [[key]], or for a fused expert tensor not stored fused,
    one group per expert ([[experts.0.gate_proj.weight, experts.0.up_proj.weight], ...])."""
    for fused, projections in _FUSED_EXPERTS.items():
        if key.endswith(fused) and not (weight_map is not None and key in weight_map):
            stem = key[: -len(fused)]
            return [[f"{stem}experts.{e}.{proj}.weight" for proj in projections] for e in range(shape[0])]
    return [[key]]


def _read_tensors(model_dir: str, weight_map: Mapping[str, str], sources: Mapping[str, list[list[str]]]
                  ) -> dict[str, torch.Tensor]:
    """hsx name -> tensor, each read from the shards holding its checkpoint keys (per-expert groups fused)."""
    from safetensors import safe_open

    wanted = sorted({key for groups in sources.values() for group in groups for key in group})
    by_file: dict[str, list[str]] = {}
    for key in wanted:
        by_file.setdefault(weight_map[key], []).append(key)
    raw: dict[str, torch.Tensor] = {}
    for file, keys in by_file.items():
        try:
            with safe_open(os.path.join(model_dir, file), framework="pt") as f:
                for key in keys:
                    raw[key] = f.get_tensor(key)
        except (OSError, ValueError, RuntimeError) as e:  # safetensors raises SafetensorError (a RuntimeError)
            raise ValueError(f"{model_dir}/{file}: cannot read its MTP tensors ({e})") from None
    out = {}
    for name, groups in sources.items():
        if len(groups) == 1 and len(groups[0]) == 1:
            out[name] = raw[groups[0][0]]
            continue
        try:
            out[name] = torch.stack([torch.cat([raw[k] for k in group]) for group in groups])
        except RuntimeError as e:
            raise ValueError(f"{model_dir}: the per-expert MTP tensors {groups[0]} do not fit together ({e}); the "
                             "MTP layers are not this target's") from None
    return out


class MtpMethod:
    """MTP in the drafter registry (pyproject.toml's hsx.drafters entry point `mtp`): a method that decodes with a
    target's own MTP layers; its checkpoints are target folders that declare MTP layers (mtp_style)."""

    name = "mtp"
    description = "a target folder with MTP layers (DeepSeek-V3 / GLM-4.5 / Qwen3-Next / Qwen3.5 style)"
    parallel_of = None
    parallel = False
    model_optional = True
    """speculative_config may leave out 'model': the target's own folder holds the layers (vLLM's default)."""

    features = Features()
    """The proposer reads layer N, pre-norm, to which it applies the target's final norm."""

    def matches(self, checkpoint_config: dict[str, Any]) -> bool:
        return mtp_style(checkpoint_config) is not None

    def num_speculative_tokens(self, checkpoint_config: dict[str, Any]) -> int | None:
        """vLLM's default k for mtp: the number of MTP layers."""
        found = mtp_style(checkpoint_config)
        return found[1] if found else None

    proposer_class = "drafters.mtp_proposer:MtpProposer"

    def proposer(self, model_dir: str | None, runner, k: int):
        from drafters.registry import load

        return load(self.proposer_class)(model_dir, runner, k)


FAMILY = MtpMethod()
