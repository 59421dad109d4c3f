"""MTP checkpoint layouts: where each target family keeps its MTP layers' tensors and what its layers compute.

    MtpStyle                       one checkpoint layout: where the tensors are, which norm the carried state gets
    STYLES                         model_type -> MtpStyle (deepseek_v3, glm4_moe, qwen3_next, qwen3_5 / qwen3_5_text)
    mtp_style(config)              the style and number of MTP layers a config.json declares (None: it declares none)
    text_config_dict(config)       a config.json's text part (a multimodal Qwen3.5's text_config), else itself
    is_mtp_key(key, style, config) whether a checkpoint key is one of the MTP layers' tensors
    read_config_json(path)         a folder's config.json as a dict; ValueError in one line saying what 'mtp' reads

What each style computes for entry p (token x_{p+1} beside the state h_p of x_p; p is the entry's position), with the
vLLM file it follows (drafters/mtp.py's MtpHead computes it):

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
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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


def text_config_dict(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) and text.get("model_type") else config


def mtp_style(config: Mapping[str, Any]) -> tuple[MtpStyle, int] | None:
    """(style, number of MTP layers) a config.json declares; None when its model_type has no MTP layout hsx knows or
    it declares 0 layers. A Qwen style without a count key declares vLLM's default (1): whether the tensors exist is
    checked when they are read."""
    outer = config.get("model_type")
    text = text_config_dict(config)
    style = STYLES.get(str(text.get("model_type"))) or STYLES.get(str(outer))
    if style is None:
        return None
    count = next((text[k] for k in style.count_keys if k in text), None)
    if count is None:
        count = next((config[k] for k in style.count_keys if k in config), style.default_count)
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return None
    return style, count


def read_config_json(path: str) -> dict[str, Any]:
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




def is_mtp_key(key: str, style: MtpStyle, doc: Mapping[str, Any]) -> bool:
    if style.shared_parts:
        return key.startswith("mtp.")
    n = int(text_config_dict(doc)["num_hidden_layers"])
    return key.startswith("model.layers.") and int(key.split(".")[2]) >= n


