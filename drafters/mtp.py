"""MTP: the target's own multi-token-prediction layers as its drafter (vLLM's `method: "mtp"`).

Many targets ship MTP layers in their checkpoint beside the decoder (DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5);
transformers drops them at load (`_keys_to_ignore_on_load_unexpected`), so hsx reads those tensors from the
checkpoint's safetensors itself and builds each MTP layer from the target family's own transformers decoder layer.

    MtpHead             the MTP layers of one target, loaded from a folder (the target's own, a copy of it with tuned
                        layers, or a standalone `hsx train-drafter --kind mtp` checkpoint):
        decode(ids, hidden, positions, mask, cache) -> [R, S, L, H]   every MTP layer over the same entries
        logits(carried, j)                                            MTP layer j's logits over its carried state
    checkpoint_tensors(head)   its tensors under the checkpoint's own keys (what a tuned head writes)
    MtpConfig, MtpDrafter      fine-tuning the MTP layers on an hsx run (`hsx train-drafter --kind mtp`)
    FEATURES, FAMILY           what it reads from a run; MTP in the drafter registry (its proposer:
                               drafters/mtp_proposer.py)

Beside it: drafters/mtp_styles.py (the per-family layouts, MtpStyle, mtp_style, and what each style computes) and
drafters/mtp_checkpoint.py (reading the target's MTP tensors, the merge writer, the check that layers were made for
a target, the registry's preflight).

Chaining (k > L): draft step s reads MTP layer s % L, as vLLM's `spec_step_idx % num_mtp_layers`. Unlike vLLM, whose
layers j >= 1 attend over KV slots only they wrote (holes for L > 1), every MTP layer here is fed every entry (the
verified ones and each draft), so each has a full cache: the same drafts as vLLM for L = 1, the case of every
shipped checkpoint hsx knows (vLLM's qwen3_next_mtp.py also always runs layer 0; for L = 1 that is the same).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from drafters.attention import ATTN_IMPLEMENTATION
from drafters.base import Drafter, DrafterBatch, StepResult, TargetHead, target_folder, write_checkpoint
from drafters.features import Features
from drafters.llama_layers import cache_kwarg
from drafters.memory import chunked_argmax, cross_entropy, softmax_of
from drafters.mtp_checkpoint import check_source, expert_sources, mtp_weight_map, read_mtp_tensors
from drafters.mtp_styles import STYLES, MtpStyle, mtp_style, read_config_json, text_config_dict
from drafters.registry import Family
from drafters.target_identity import target_digest
from drafters.ttt import needed_chains, unroll_chains

FEATURES = Features()
"""MTP layers read layer N's state (through the target's final norm): no aux layers, no top-k target."""


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
    """The config MTP decoder layers are built from: drafters.attention's (a TTTAttention in training, the
    proposer's boolean masks through sdpa), full attention at every index an MTP layer is built with."""
    config = copy.deepcopy(hf_config)
    config._attn_implementation = ATTN_IMPLEMENTATION  # training's TTTAttention ranged, decoding's masks to sdpa
    if getattr(config, "layer_types", None) is not None:  # hybrids (Qwen3-Next): MTP layers attend in full
        config.layer_types = ["full_attention"] * (int(config.num_hidden_layers) + count)
    return config


class MtpHead(nn.Module):
    """The MTP layers of one target (what each style computes: drafters/mtp_styles.py). Its tensors stay in the
    checkpoint's key names (checkpoint_keys()), so a tuned copy is written back into a target folder unchanged in
    layout."""

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
            for name in block.state_dict():  # parameters and persistent buffers (DeepSeek's e_score_correction_bias)
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
        doc = read_config_json(os.path.join(model_dir, "config.json"))
        found = mtp_style(doc)
        if found is None:
            kinds = ", ".join(sorted({s.name for s in STYLES.values()}))
            raise ValueError(f"{model_dir} declares no MTP layers (model_type "
                             f"{text_config_dict(doc).get('model_type')!r}, num_nextn_predict_layers / "
                             f"mtp_num_hidden_layers unset or 0); method 'mtp' needs a target whose checkpoint ships "
                             f"them ({kinds} styles), or another method (e.g. eagle3 with a trained head)")
        style, count = found
        text = text_config_dict(doc)
        quantized = doc.get("quantization_config") or text.get("quantization_config")
        if quantized:
            method = quantized.get("quant_method") if isinstance(quantized, Mapping) else quantized
            raise ValueError(f"{model_dir}: its MTP layers are quantized ({method!r}: weights with their own scales); "
                             "hsx reads MTP layers of bf16/fp16/fp32 checkpoints only: use the unquantized checkpoint")
        for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
            want = getattr(hf_config, key)
            if key in text and int(text[key]) != int(want):
                raise ValueError(f"{model_dir}: its MTP layers are for a target with {key} {text[key]}, this target "
                                 f"has {want}; use the target's own folder or an MTP checkpoint trained on it")
        weight_map = mtp_weight_map(model_dir)
        n = int(hf_config.num_hidden_layers)
        optional = tuple(f"{kind}{j}" for j in range(count) for kind, suffix in style.optional_keys.items()
                         if style.parts_prefix(n, j) + suffix in weight_map)
        head = cls(hf_config, style, count, embed_tokens, lm_head, optional)
        own, keys = head.state_dict(), head.checkpoint_keys()
        sources = {name: expert_sources(key, tuple(own[name].shape), weight_map) for name, key in keys.items()}
        missing = [key for groups in sources.values() for group in groups for key in group if key not in weight_map]
        if missing:
            raise ValueError(f"{model_dir} declares {count} MTP layer(s) ({style.name} style) but its checkpoint lacks "
                             f"{len(missing)} of their tensors, e.g. {missing[:3]}; a target whose MTP weights were "
                             "dropped (e.g. re-saved by transformers) cannot run method 'mtp' (decode it with another "
                             "method, or method draft_model for a smaller model)")
        state = read_mtp_tensors(model_dir, weight_map, sources)
        for name, tensor in state.items():
            key = keys[name]
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(f"{model_dir}: MTP tensor {key} has shape {tuple(tensor.shape)}, the target's "
                                 f"config makes it {tuple(own[name].shape)}; the MTP layers are not this target's")
            if tensor.is_floating_point() and tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"{model_dir}: MTP tensor {key} is {str(tensor.dtype).removeprefix('torch.')}; hsx "
                                 "reads MTP layers stored in bf16/fp16/fp32 (use the unquantized checkpoint)")
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{model_dir}: MTP tensor {key} holds non-finite values (NaN or inf); the "
                                 "checkpoint is damaged")
        head.to(dtype or embed_tokens.dtype)
        for name, t in [*head.named_parameters(), *head.named_buffers()]:
            if name.endswith("e_score_correction_bias"):  # kept in float32, as transformers keeps DeepSeek's
                t.data = t.data.float()
        head.load_state_dict(state, strict=True)
        return head.to(device or embed_tokens.device).eval().requires_grad_(False)


# -- checkpoints in the target's own layout ----------------------------------------------------------------------------
def checkpoint_tensors(head: MtpHead) -> dict[str, torch.Tensor]:
    """The head's tensors under the checkpoint's own keys, experts one by one as checkpoints store them (the reverse
    of from_folder's reading): what a tuned head writes, standalone or back into a copy of its target."""
    state = head.state_dict()
    out = {}
    for name, key in head.checkpoint_keys().items():
        tensor = state[name].detach()
        groups = expert_sources(key, tuple(tensor.shape))
        if len(groups) == 1 and len(groups[0]) == 1:
            out[key] = tensor.contiguous()
            continue
        for e, group in enumerate(groups):
            for piece, k in zip(tensor[e].chunk(len(group)), group):
                out[k] = piece.contiguous()
    return out


# -- fine-tuning (hsx train-drafter --kind mtp) ------------------------------------------------------------------
@dataclass(frozen=True)
class MtpConfig:
    """MTP fine-tuning options (`hsx train-drafter --kind mtp`; --ttt-steps, --family-options '{"beta": 0.6}')."""

    ttt_steps: int = 3
    """Chained positions trained: step s feeds the state step s - 1 carried (drafts s + 1 tokens ahead), through MTP
    layer s % L, as decoding does."""
    beta: float = 0.6
    """Step s weighs beta^s (normalised to sum 1): FastMTP's weights, speculators' default."""

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        if not 0 < self.beta <= 1:
            raise ValueError(f"beta must be in (0, 1], got {self.beta}")

    def weights(self) -> list[float]:
        raw = [self.beta ** s for s in range(self.ttt_steps)]
        return [w / sum(raw) for w in raw]


class MtpDrafter(Drafter):
    """A target's MTP layers being fine-tuned on an hsx run: only the MTP layers train (the embeddings and lm_head are
    the target's, frozen and shared; a layer's own copies stay frozen too); the loss is the cross-entropy against the
    target's own next-token distribution at each chained position, weighted beta^s."""

    kind = "mtp"
    features = FEATURES

    def __init__(self, head: MtpHead, config: MtpConfig, target_norm: nn.Module, num_speculative_tokens: int,
                 verifier: str, target_config: dict[str, Any]) -> None:
        super().__init__()
        self.head = head
        self.config = config
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.verifier = verifier
        self.target_config = target_config
        self._digest: tuple[str, str] | None = None  # (verifier, its target_digest)
        self.target_norm = target_norm.requires_grad_(False)
        for name, p in head.named_parameters():
            p.requires_grad_(not name.startswith("own."))

    @classmethod
    def for_run(cls, run_spec, target: TargetHead, num_speculative_tokens: int, **family_options: Any) -> MtpDrafter:
        config = MtpConfig(**family_options)
        n = int(run_spec.num_hidden_layers)
        if run_spec.target_top_k is not None or n not in tuple(run_spec.layer_ids):
            instead = " with a top-k target in its place" if run_spec.target_top_k is not None else ""
            raise ValueError(f"MTP layers read the target's last layer (id {n}) through its final norm, but the run "
                             f"stores {list(run_spec.layer_ids)}{instead}; re-extract with layer {n} in --layers (no "
                             "--target top_k)")
        folder = target_folder(target, "MTP")
        doc = read_config_json(os.path.join(folder, "config.json"))
        head = MtpHead.from_folder(folder, hf_config=_hf_text_config(folder), embed_tokens=target.embed_tokens.float(),
                                   lm_head=target.lm_head.float(), dtype=torch.float32, device="cpu")
        norm = target.norm.to(torch.float32).module
        return cls(head.train(), config, norm, num_speculative_tokens, os.path.abspath(folder), doc).to(torch.float32)

    def _decode_step(self, step: list[int]):
        """unroll_chains' decode for this family: every MTP layer over the step's entries (their caches all hold
        every entry, as decoding's), the step's own layer's output returned."""
        def decode(ids, hidden, positions, mask, cache):
            s = step[0]
            step[0] += 1
            return self.head.decode(ids, hidden, positions, mask, cache)[..., s % self.head.count, :]
        return decode

    def training_step(self, batch: DrafterBatch, target: TargetHead) -> StepResult:
        n = int(self.head.num_hidden_layers)
        dtype = self.head.parts[0].proj.weight.dtype
        with torch.no_grad():
            features = self.target_norm(batch.layer(n).to(dtype))  # [R, S, H] what the target hands its MTP layers
        steps = self.config.ttt_steps
        trained = [batch.same_document(2 + s) & batch.shifted(batch.loss_mask, 2 + s, False) for s in range(steps)]
        outputs = unroll_chains(self._decode_step([0]), features, batch.input_ids, batch.position_ids,
                                batch.document_ids, needed_chains(trained))
        loss = torch.zeros((), dtype=torch.float32, device=features.device)
        correct = torch.zeros(steps, dtype=torch.long)
        counted = torch.zeros(steps, dtype=torch.long)
        for s, (step, weight) in enumerate(zip(outputs, self.config.weights())):
            rows, cols = trained[s].nonzero(as_tuple=True)
            counted[s] = rows.numel()
            if not rows.numel():
                continue
            carried = step.take(rows, cols)  # [M, H]
            want = features[rows, cols + 1 + s]  # [M, H] the target's state that predicts x_{t+2+s}

            def logits(x, j=s % self.head.count):
                return self.head.logits(x, j)

            def teacher(x):
                return x @ self.head.target_lm_head.to(x.dtype).T

            total, best = cross_entropy(carried, logits, softmax_of(teacher, want), chunk=self.memory.ce_chunk_tokens)
            loss = loss + weight * total / rows.numel()
            with torch.no_grad():
                correct[s] = int((best == chunked_argmax(teacher, want, self.memory.ce_chunk_tokens)).sum())
        if not int(counted.sum()):
            loss = outputs[0].hidden.sum() * 0.0
        return StepResult(loss, correct, counted)

    def recomputable(self) -> list[nn.Module]:
        """--gradient-checkpointing: the MTP layers' MLPs (their attention writes the unroll's keys)."""
        return [block.mlp for block in self.head.blocks if hasattr(block, "mlp")]

    # -- checkpoint: the target's config and the MTP tensors under the checkpoint's own keys ------------------------
    def save_pretrained(self, out_dir: str, *, verifier: str) -> None:
        if verifier:
            self.verifier = verifier
        doc = dict(self.target_config)
        doc["hsx"] = {"kind": self.kind, "verifier": self.verifier, "num_speculative_tokens":
                      self.num_speculative_tokens, **asdict(self.config)}
        if os.path.isdir(self.verifier):  # which target the layers were tuned for, told by content (merge, decode)
            if self._digest is None or self._digest[0] != self.verifier:  # hashed once, not at every checkpoint
                self._digest = (self.verifier, target_digest(self.verifier))
            doc["hsx"]["target_digest"] = self._digest[1]
        write_checkpoint(out_dir, doc, checkpoint_tensors(self.head))

    @classmethod
    def from_pretrained(cls, model_dir: str, *, target_dir: str | None = None,
                        allow_target_mismatch: bool = False) -> MtpDrafter:
        """A saved MTP checkpoint, its embeddings, lm_head and final norm read from its target (`target_dir`, default
        the verifier it records). ValueError when it was tuned for another target (check_source), unless
        `allow_target_mismatch` (then logged)."""
        doc = read_config_json(os.path.join(model_dir, "config.json"))
        hsx = doc.get("hsx") if isinstance(doc.get("hsx"), dict) else {}
        target_dir = target_dir or hsx.get("verifier") or ""
        if not target_dir or not os.path.isdir(target_dir):
            raise ValueError(f"{model_dir}: an MTP checkpoint reads its target's embeddings and lm_head, but its "
                             f"target {target_dir!r} is not a local folder; pass the target folder")
        check_source(model_dir, target_dir, "the MTP checkpoint", allow_mismatch=allow_target_mismatch,
                     override="pass allow_target_mismatch=True")
        target = TargetHead.from_model_dir(target_dir)
        head = MtpHead.from_folder(model_dir, hf_config=_hf_text_config(target_dir),
                                   embed_tokens=target.embed_tokens.float(), lm_head=target.lm_head.float(),
                                   dtype=torch.float32, device="cpu")
        known = {f.name for f in fields(MtpConfig)}
        config = MtpConfig(**{k: v for k, v in hsx.items() if k in known})
        target_doc = {k: v for k, v in doc.items() if k != "hsx"}
        return cls(head, config, target.norm.to(torch.float32).module, int(hsx.get("num_speculative_tokens") or 3),
                   target_dir, target_doc).eval()


def _hf_text_config(folder: str):
    from transformers import AutoConfig

    from extractor.facts import text_config

    return text_config(AutoConfig.from_pretrained(folder))


def _speculative_tokens(config: dict[str, Any]) -> int | None:
    """A tuned checkpoint's recorded k, else vLLM's default for mtp: the number of MTP layers."""
    recorded = (config.get("hsx") or {}).get("num_speculative_tokens") if isinstance(config.get("hsx"), dict) else None
    if isinstance(recorded, int):
        return recorded
    found = mtp_style(config)
    return found[1] if found else None


FAMILY = Family(name="mtp", description="a target folder with MTP layers (DeepSeek-V3 / GLM-4.5 / Qwen3-Next / "
                "Qwen3.5 style) or a `hsx train-drafter --kind mtp` checkpoint",
                drafter="drafters.mtp:MtpDrafter", proposer_class="drafters.mtp_proposer:MtpProposer",
                config_matches=lambda config: mtp_style(config) is not None, config_k=_speculative_tokens,
                options=("ttt_steps",), features=FEATURES, model_optional=True,
                preflight="drafters.mtp_checkpoint:preflight")
"""MTP in the drafter registry (pyproject.toml's hsx.drafters entry point `mtp`); 'model' may be left out (the
target's own folder, as vLLM)."""
