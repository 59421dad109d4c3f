"""EAGLE (EAGLE-1; vLLM's `method: "eagle"`, ModelOpt's EAGLE module with `eagle_num_layers`): a draft decoder that
regresses the target's next feature — its post-norm last-layer state — from the current feature and the next
token's embedding, and reads it out with the target's own lm_head.

    EagleConfig      num_layers (ModelOpt's eagle_num_layers), unroll steps, loss weights
    EagleDrafter     the model (Drafter kind "eagle"):
        embed_tokens  [V, H]     the target's input embeddings, frozen (written to the checkpoint, as EAGLE's are)
        fc            [H, 2H]    over [embedding of x_{t+1} ; feature of x_t], no bias
        layers        Llama decoder layers; layer 0 has no input_layernorm (identity), as vLLM's llama_eagle.py
        (no final norm) the output is the predicted feature of x_{t+1}
        target_norm, target_lm_head   the target's final norm and lm_head, frozen and never written: the checkpoint
                                      holds only the draft's weights; they are loaded from the target (the verifier)
    FEATURES, FAMILY what it reads from a run (layer N), EAGLE in the drafter registry
    (its proposer, EagleProposer, is drafters/eagle_proposer.py: Eagle3Proposer's row cache and loop, fed the
    target's last layer through its final norm)

Feature of x_t = the target's last decoder layer output of x_t after its final norm (what lm_head reads; hsx stores
layer N pre-norm, so the norm is applied here, exactly as the target does). Decoding: step 0 reads (feature of x_t,
x_{t+1}) and gives f^_{t+1}; lm_head(f^_{t+1}) drafts x_{t+2}; step s feeds back its own f^ with the token it
drafted. Training unrolls those steps (test-time training, the same attention layout as EAGLE-3's: drafters/ttt.py)
and, per step s, chains t whose x_{t+2+s} is trained and in t's document:
    loss_s = regression_weight * SmoothL1(f^, f_{t+1+s}) + classification_weight * CE(lm_head f^, softmax(lm_head f_{t+1+s}))
the EAGLE paper's feature regression plus its token loss (weights 1.0 and 0.1, as its trainer).

Checkpoint: the layout vLLM's `eagle` method reads — a Llama config.json (architectures ["EagleLlamaForCausalLM"],
num_hidden_layers = the draft's depth) and model.safetensors with `fc.weight`, `layers.{i}.self_attn.{q,k,v,o}_proj`,
`layers.{i}.mlp.{gate,up,down}_proj`, `layers.{i}.post_attention_layernorm`, `layers.{i>0}.input_layernorm`, and
`embed_tokens.weight`; vLLM shares the target's lm_head. hsx's own options ride in config.json under "hsx_eagle",
with the verifier's path (from which hsx loads the lm_head and final norm when the engine does not hand it its own).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import (
    WEIGHTS_NAME,
    Drafter,
    DrafterBatch,
    StepResult,
    TargetHead,
    load_weights,
    read_checkpoint_json,
    target_folder,
    verifier_head,
)
from drafters.features import Features
from drafters.llama_layers import cache_kwarg, llama_layer_config, with_draft_attention
from drafters.memory import chunked_argmax, cross_entropy, softmax_of
from drafters.registry import Family
from drafters.ttt import needed_chains, unroll_chains

ARCHITECTURE = "EagleLlamaForCausalLM"

FEATURES = Features()
"""EAGLE reads layer N's state itself (its feature, through the target's final norm): no aux layers, no top-k
target."""


@dataclass(frozen=True)
class EagleConfig:
    """EAGLE's options (`hsx train-drafter --kind eagle`; --family-options '{"num_layers": 2}')."""

    num_layers: int = 1
    """Draft decoder layers (ModelOpt's eagle_num_layers; EAGLE uses 1)."""
    ttt_steps: int = 3
    """Unroll: each chain is trained on this many consecutive drafts fed its own features (1 = EAGLE's one-step
    training; more makes later drafts better, as EAGLE-3 found)."""
    regression_weight: float = 1.0
    """Weight of the feature regression (SmoothL1) in each step's loss."""
    classification_weight: float = 0.1
    """Weight of the token loss (cross-entropy against the target's distribution)."""
    intermediate_size: int | None = None
    """MLP width of the draft layers; None = the target's."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1 (1 = no unroll), got {self.ttt_steps}")
        if self.regression_weight < 0 or self.classification_weight < 0 or \
                not self.regression_weight + self.classification_weight > 0:
            raise ValueError("regression_weight and classification_weight must be >= 0, not both 0")


class EagleDrafter(Drafter):
    """The EAGLE draft model (see the module docstring)."""

    kind = "eagle"
    reads_image_embeddings = True
    features = FEATURES

    def __init__(self, config: EagleConfig, layer_config, target: TargetHead, num_speculative_tokens: int = 3,
                 verifier: str = "") -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        self.config = config
        self.layer_config = with_draft_attention(layer_config)
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.verifier = verifier
        h, vocab = layer_config.hidden_size, layer_config.vocab_size
        self.target_hidden_size = h
        self.embed_tokens = nn.Embedding(vocab, h)  # [V, H] the target's, frozen
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(2 * h, h, bias=False)  # [H, 2H] over [embedding ; feature]
        self.layers = nn.ModuleList([LlamaDecoderLayer(layer_config, i) for i in range(config.num_layers)])
        self.layers[0].input_layernorm = nn.Identity()  # as vLLM's llama_eagle.py: the fc output goes in as is
        self.rotary_emb = LlamaRotaryEmbedding(layer_config)
        self.target_norm = target.norm.to(torch.float32).module.requires_grad_(False)  # the target's, never saved
        self.register_buffer("target_lm_head", target.lm_head.detach(), persistent=False)  # shared, not copied

    # -- the proposer's interface (drafters/eagle3_proposer.py's loop) -----------------------------------------
    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target layer the engine captures: N, the last, pre-norm (fuse applies the final norm)."""
        return (int(self.layer_config.num_target_layers),)

    @property
    def draft_ids(self) -> torch.Tensor:
        """[V] the draft vocabulary is the target's."""
        return torch.arange(self.layer_config.vocab_size, device=self.target_lm_head.device)

    def fuse(self, last: torch.Tensor) -> torch.Tensor:
        """last [..., 1, H] the target's last layer, pre-norm -> [..., H] its feature (post-norm)."""
        return self.target_norm(last[..., 0, :].to(self.fc.weight.dtype))

    def decode(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
        """input_ids [R, S] (x_{t+1}), hidden [R, S, H] (feature of x_t, or the previous step's output) -> [R, S, H]
        the predicted feature of x_{t+1}; attention over the cache's keys as Eagle3Drafter.decode."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        rope = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask, position_ids=position_ids, **cache_kwarg(cache),
                      position_embeddings=rope)
        return x

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """[..., H] a feature -> [..., V] the target's lm_head over it."""
        return feature @ self.target_lm_head.to(feature.dtype).T

    # -- construction -------------------------------------------------------------------------------------------
    @classmethod
    def for_run(cls, run_spec, target: TargetHead, num_speculative_tokens: int, **family_options: Any) -> EagleDrafter:
        config = EagleConfig(**family_options)
        n = int(run_spec.num_hidden_layers)
        if run_spec.target_top_k is not None:
            raise ValueError(f"EAGLE reads the state of the target's last layer (id {n}); this run stores a top-k "
                             "target in its place (--target top_k): re-extract without --target top_k, with layer "
                             f"{n} in --layers")
        if n not in tuple(run_spec.layer_ids):
            raise ValueError(f"EAGLE reads the target's last layer (id {n}), but the run stores layers "
                             f"{list(run_spec.layer_ids)}; re-extract with --layers ...,{n}")
        target_folder(target, "EAGLE")
        layer_config = llama_layer_config(target.model_dir, target.hidden_size, target.vocab_size,
                                          num_layers=config.num_layers, intermediate_size=config.intermediate_size)
        layer_config.num_target_layers = n
        model = cls(config, layer_config, target, num_speculative_tokens, verifier=os.path.abspath(target.model_dir))
        with torch.no_grad():
            model.embed_tokens.weight.copy_(target.embed_tokens.to(torch.float32))
        return model.to(torch.float32)  # trained in float32, the target's lm_head too

    # -- training -----------------------------------------------------------------------------------------------
    def training_step(self, batch: DrafterBatch, target: TargetHead) -> StepResult:
        n = int(self.layer_config.num_target_layers)
        with torch.no_grad():
            features = self.target_norm(batch.layer(n).to(self.fc.weight.dtype))  # [R, S, H] f_t
        steps = self.config.ttt_steps
        # chains whose x_{t+2+s} is trained and in t's document; step s runs those it or a later step trains
        trained = [batch.same_document(2 + s) & batch.shifted(batch.loss_mask, 2 + s, False) for s in range(steps)]
        images = batch.input_overrides()  # an image run: the target's merged embeddings at image tokens
        outputs = unroll_chains(self.decode, features, batch.input_ids, batch.position_ids, batch.document_ids,
                                needed_chains(trained),
                                **({} if images is None else {"images": (self.embed_tokens, *images)}))
        loss = torch.zeros((), dtype=torch.float32, device=features.device)
        correct = torch.zeros(steps, dtype=torch.long)
        counted = torch.zeros(steps, dtype=torch.long)
        for s, step in enumerate(outputs):
            rows, cols = trained[s].nonzero(as_tuple=True)
            counted[s] = rows.numel()
            if not rows.numel():
                continue
            pred = step.take(rows, cols)  # [M, H] f^_{t+1+s}
            want = features[rows, cols + 1 + s]  # [M, H] f_{t+1+s}
            # the token loss against the target's distribution of x_{t+2+s} (its lm_head over f_{t+1+s}); the
            # [M, V] logits in chunks with --ce-chunk-tokens
            total, best = cross_entropy(pred, self.logits, softmax_of(self.logits, want),
                                        chunk=self.memory.ce_chunk_tokens)
            step_loss = (self.config.regression_weight * F.smooth_l1_loss(pred.float(), want.float())
                         + self.config.classification_weight * total / rows.numel())
            loss = loss + step_loss
            with torch.no_grad():
                correct[s] = int((best == chunked_argmax(self.logits, want, self.memory.ce_chunk_tokens)).sum())
        if not int(counted.sum()):  # nothing trained in the batch: a zero that still reaches the draft layers
            loss = outputs[0].hidden.sum() * 0.0
        return StepResult(loss, correct, counted)

    def recomputable(self) -> list[nn.Module]:
        """--gradient-checkpointing: the draft layers' MLPs (their attention writes the unroll's keys)."""
        return [layer.mlp for layer in self.layers]

    # -- checkpoint (vLLM's eagle layout) -------------------------------------------------------------------------
    def checkpoint_config(self) -> dict[str, Any]:
        doc = self.layer_config.to_dict()
        for key in ("_attn_implementation_autoset", "num_target_layers"):
            doc.pop(key, None)
        doc.update(architectures=[ARCHITECTURE], model_type="llama", torch_dtype=str(self.fc.weight.dtype)
                   .removeprefix("torch."), num_hidden_layers=self.config.num_layers)
        doc["hsx_eagle"] = {**asdict(self.config), "verifier": self.verifier,
                            "target_num_hidden_layers": int(self.layer_config.num_target_layers),
                            "num_speculative_tokens": self.num_speculative_tokens}
        return doc

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("target_norm.")}

    @classmethod
    def from_pretrained(cls, model_dir: str, *, target_dir: str | None = None, target: TargetHead | None = None,
                        device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> EagleDrafter:
        """Reload a checkpoint; the lm_head and final norm are `target`'s (a loaded target's, shared: the head is
        built in its dtype and on its device unless `dtype` / `device` say otherwise), else read from `target_dir`
        (default: the verifier it records)."""
        from safetensors.torch import load_file
        from transformers import LlamaConfig

        if target is not None:  # a loaded target's tensors stay shared: its dtype and device unless told otherwise
            dtype, device = dtype or target.lm_head.dtype, device or target.lm_head.device

        doc = read_checkpoint_json(model_dir, "an EAGLE")
        if not _is_eagle(doc):
            raise ValueError(f"{model_dir}: config.json has architectures {doc.get('architectures')}, not "
                             f"[{ARCHITECTURE!r}]: not an EAGLE checkpoint")
        hsx = doc.get("hsx_eagle") or {}
        target_dir = target_dir or hsx.get("verifier") or ""
        layer_config = LlamaConfig.from_dict({k: v for k, v in doc.items() if k != "hsx_eagle"})
        target = verifier_head(model_dir, target_dir, layer_config.hidden_size, layer_config.vocab_size, "EAGLE",
                               target)
        layer_config.num_target_layers = int(hsx.get("target_num_hidden_layers") or target.num_hidden_layers)
        known = {f.name for f in fields(EagleConfig)}
        options = {k: v for k, v in hsx.items() if k in known}
        options["num_layers"] = int(layer_config.num_hidden_layers)
        model = cls(EagleConfig(**options), layer_config, target, int(hsx.get("num_speculative_tokens") or 3),
                    verifier=target_dir)
        state = {k.removeprefix("model."): v for k, v in load_file(os.path.join(model_dir, WEIGHTS_NAME)).items()}
        if "embed_tokens.weight" not in state:  # vLLM shares the target's when absent
            state["embed_tokens.weight"] = target.embed_tokens
        model.to(dtype or getattr(torch, doc.get("torch_dtype") or "float32"))
        load_weights(model, model_dir, state, not_written=("target_norm.",), kind="EAGLE")
        return model.to(device or "cpu").eval()


def _is_eagle(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or [])


def _speculative_tokens(config: dict) -> int | None:
    return (config.get("hsx_eagle") or {}).get("num_speculative_tokens")


FAMILY = Family(name="eagle", description="an EAGLE (EAGLE-1, vLLM's eagle method) checkpoint",
                drafter="drafters.eagle:EagleDrafter", proposer_class="drafters.eagle_proposer:EagleProposer",
                config_matches=_is_eagle, config_k=_speculative_tokens, options=("ttt_steps",), features=FEATURES)
"""EAGLE in the registry (pyproject.toml's hsx.drafters entry point `eagle`)."""
