"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"):
K heads on the target's last post-norm state, each `medusa_num_layers` residual blocks then its own lm_head.

    MedusaConfig            medusa_num_heads (K), medusa_num_layers (ModelOpt's names), loss weighting
    MedusaDrafter           the heads; kind "medusa": for_run / training_step / save_pretrained / from_pretrained
    FEATURES, FAMILY        what it reads from a run (layer N), Medusa in the drafter registry
    (its proposer, MedusaProposer, is drafters/medusa_proposer.py; the pieces it shares with MLPSpeculator are
    drafters/last_state.py and drafters/last_state_proposer.py)

Alignment (base.py): position t holds x_t and the target's state of x_t; the target's own lm_head reads that state
and predicts x_{t+1}; head j (0-based) reads the same post-norm state and predicts x_{t+2+j}.

    head j:  h = post_norm(state of x_t)               # [.., H]
             h = h + SiLU(W_jl h + b_jl), l < L         # L = medusa_num_layers residual blocks
             logits_j = lm_head_j h                     # [.., V], lm_head_j initialised from the target's

Training targets: by default the target's own next-token distribution at the position that predicts x_{t+2+j}
(TargetHead on the stored last layer of x_{t+1+j}; self-distillation, which Medusa recommends when the training text
is not the target's own output, as hsx runs over corpora are not), or the corpus tokens (`targets="tokens"`,
Medusa-1 as published). Head j's loss weighs medusa_decay_coefficient ** j, as Medusa's trainer does.

Checkpoint: the layout vLLM's `medusa` method loads (vllm/model_executor/models/medusa.py): config.json with
model_type "medusa", architectures ["MedusaModel"], hidden_size, vocab_size, num_heads, num_hidden_layers (blocks per
head), max_paths, topk, truncated_vocab_size (= vocab_size: no token_map), medusa_fc_bias, original_lm_head (false;
a checkpoint whose heads share lm_heads.0 loads too); weights blocks.{i}.layers.{l}.weight/.bias [H, H]/[H] and
lm_heads.{i}.weight [V, H].
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import (
    Drafter,
    DrafterBatch,
    StepResult,
    TargetHead,
    load_state,
    read_config,
    read_tensors,
    write_checkpoint,
)
from drafters.features import Features
from drafters.last_state import TARGETS, TeacherLogits, check_run_fits, drop_draft_count, head_loss, predicted_mask
from drafters.registry import Family

FEATURES = Features()
"""Medusa reads layer N's state itself (pre-norm; the heads read it through the target's final norm): no aux
layers, no top-k target."""

@dataclass(frozen=True)
class MedusaConfig:
    """Medusa's shape (ModelOpt's `mtsp.convert` names) and how its heads are trained."""

    medusa_num_heads: int = 3
    """K heads = the most drafts per step (num_speculative_tokens)."""
    medusa_num_layers: int = 1
    """Residual blocks (x + SiLU(Linear(x))) per head before its lm_head."""
    medusa_decay_coefficient: float = 0.8
    """Head j's loss is weighted decay ** j (Medusa's trainer), later heads being harder and worth less."""
    targets: str = "target"
    """"target": the target's next-token distribution (distillation); "tokens": the run's tokens (hard labels)."""

    def __post_init__(self) -> None:
        if not isinstance(self.medusa_num_heads, int) or self.medusa_num_heads < 1:
            raise ValueError(f"medusa_num_heads must be an integer >= 1, got {self.medusa_num_heads!r}")
        if not isinstance(self.medusa_num_layers, int) or self.medusa_num_layers < 0:
            raise ValueError(f"medusa_num_layers must be an integer >= 0, got {self.medusa_num_layers!r}")
        if not 0 < self.medusa_decay_coefficient <= 1:
            raise ValueError(f"medusa_decay_coefficient must be in (0, 1], got {self.medusa_decay_coefficient}")
        if self.targets not in TARGETS:
            raise ValueError(f"targets must be one of {list(TARGETS)}, got {self.targets!r}")


class ResidualBlock(nn.Module):
    """x + SiLU(Linear(x)); the linear starts at zero, so an untrained block is the identity (Medusa's init)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaDrafter(Drafter):
    """K Medusa heads for a target of hidden size H and vocabulary V."""

    kind: ClassVar[str] = "medusa"
    features = FEATURES

    def __init__(self, config: MedusaConfig, hidden_size: int, vocab_size: int,
                 lm_head: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.hidden_size, self.vocab_size = int(hidden_size), int(vocab_size)
        k, n_layers = config.medusa_num_heads, config.medusa_num_layers
        self.blocks = nn.ModuleList(nn.Sequential(*[ResidualBlock(hidden_size) for _ in range(n_layers)])
                                    for _ in range(k))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(k))
        if lm_head is not None:
            if tuple(lm_head.shape) != (vocab_size, hidden_size):
                raise ValueError(f"lm_head has shape {tuple(lm_head.shape)}, expected {(vocab_size, hidden_size)}")
            with torch.no_grad():
                for head in self.lm_heads:
                    head.weight.copy_(lm_head)
        self.input_normalized = False
        """True when the run stored the last layer post-norm already (RunSpec.last_layer_normalized): then the
        stored state is used as is. Not part of the checkpoint (decoding always applies the target's norm)."""
        self.last_layer_id: int | None = None
        """N, the vLLM id of the layer training reads (set by for_run; None: the batch's highest stored id)."""

    @property
    def num_heads(self) -> int:
        return self.config.medusa_num_heads

    @property
    def max_drafts(self) -> int:
        """The most tokens one propose step can draft (one per head)."""
        return self.config.medusa_num_heads

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def for_run(cls, run_spec: Any, target: TargetHead, num_speculative_tokens: int,
                **family_options: Any) -> MedusaDrafter:
        """K = num_speculative_tokens heads, lm_heads copied from the target's; family_options: MedusaConfig's
        other fields (medusa_num_layers, medusa_decay_coefficient, targets)."""
        drop_draft_count(family_options, "medusa_num_heads", num_speculative_tokens, "Medusa has one head")
        config = MedusaConfig(medusa_num_heads=num_speculative_tokens, **family_options)
        check_run_fits(run_spec, target)
        drafter = cls(config, target.hidden_size, target.vocab_size, target.lm_head.float())
        drafter.input_normalized = bool(getattr(run_spec, "last_layer_normalized", False))
        drafter.last_layer_id = int(run_spec.num_hidden_layers)
        return drafter

    # -- the model ---------------------------------------------------------------------------------------------
    def forward(self, post_norm: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """post_norm [..., H] (the target's state after its final norm) -> logits [K', ..., V] of the first K'
        heads (default all): head j's logits for the token 2 + j after the state's own token."""
        k = self.num_heads if num_heads is None else num_heads
        x = post_norm.to(self.lm_heads[0].weight.dtype)
        return torch.stack([self.lm_heads[j](self.blocks[j](x)) for j in range(k)])

    def head_logits(self, j: int, post_norm: torch.Tensor) -> torch.Tensor:
        """Head j: post_norm [..., H] -> [..., V]."""
        return self.lm_heads[j](self.blocks[j](post_norm))

    def recomputable(self) -> list[nn.Module]:
        """--gradient-checkpointing: every head's residual blocks."""
        return [block for blocks in self.blocks for block in blocks]

    # -- training ----------------------------------------------------------------------------------------------
    def training_step(self, batch: DrafterBatch, target: TargetHead) -> StepResult:
        last = batch.layer(self.last_layer_id or max(batch.layer_ids))  # [R, S, H] the stored last layer
        dtype = self.lm_heads[0].weight.dtype
        with torch.no_grad():
            post = last.to(dtype) if self.input_normalized else target.post_norm(last).to(dtype)  # [R, S, H]
        teacher = TeacherLogits.of(batch, post, target, self.memory.ce_chunk_tokens)
        weights = [self.config.medusa_decay_coefficient ** j for j in range(self.num_heads)]
        loss = post.new_zeros(())
        correct = torch.zeros(self.num_heads, dtype=torch.long)
        counted = torch.zeros(self.num_heads, dtype=torch.long)
        for j in range(self.num_heads):
            mask = predicted_mask(batch, 2 + j)  # [R, S] x_{t+2+j} is trained and in x_t's sample
            rows, cols = mask.nonzero(as_tuple=True)  # [n_j]
            where = teacher.rows(rows, cols + 1 + j)  # the target's logits for x_{t+2+j}
            mean, best = head_loss(post[rows, cols], functools.partial(self.head_logits, j),
                                   teacher.distribution(where), batch.input_ids[rows, cols + 2 + j],
                                   self.config.targets, self.memory.ce_chunk_tokens)
            loss = loss + weights[j] * mean
            correct[j] = int((best == teacher.greedy[where]).sum())
            counted[j] = rows.numel()
        return StepResult(loss, correct, counted)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str, *, verifier: str) -> None:
        config = {
            "model_type": "medusa", "architectures": ["MedusaModel"],
            "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
            "num_heads": self.num_heads, "num_hidden_layers": self.config.medusa_num_layers,
            "max_paths": 64, "topk": 10, "truncated_vocab_size": self.vocab_size, "medusa_fc_bias": True,
            "original_lm_head": False, "torch_dtype": str(self.lm_heads[0].weight.dtype).removeprefix("torch."),
            "hsx": {"kind": self.kind, "verifier": verifier, **dataclasses.asdict(self.config)},
        }
        tensors = {}
        for i in range(self.num_heads):
            for layer, block in enumerate(self.blocks[i]):
                tensors[f"blocks.{i}.layers.{layer}.weight"] = block.linear.weight  # [H, H]
                tensors[f"blocks.{i}.layers.{layer}.bias"] = block.linear.bias  # [H]
            tensors[f"lm_heads.{i}.weight"] = self.lm_heads[i].weight  # [V, H]
        write_checkpoint(out_dir, config, tensors)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> MedusaDrafter:
        raw = read_config(model_dir, "medusa")
        hsx = raw.get("hsx") or {}
        known = {f.name for f in dataclasses.fields(MedusaConfig)}
        options = {k: v for k, v in hsx.items() if k in known}
        options["medusa_num_heads"] = int(raw.get("num_heads", raw.get("medusa_num_heads", 0)))
        options["medusa_num_layers"] = int(raw.get("num_hidden_layers", raw.get("medusa_num_layers", 1)))
        try:
            config = MedusaConfig(**options)
            drafter = cls(config, int(raw["hidden_size"]), int(raw["vocab_size"]))
        except (KeyError, ValueError) as e:
            raise ValueError(f"{model_dir}/config.json is not a Medusa config hsx can load ({e})") from e
        tensors = read_tensors(model_dir)
        if int(raw.get("truncated_vocab_size", drafter.vocab_size)) != drafter.vocab_size or "token_map" in tensors:
            raise ValueError(f"{model_dir} is a Medusa checkpoint with a truncated vocabulary (token_map); hsx loads "
                             "full-vocabulary heads only")
        shared = tensors.get("lm_heads.0.weight", tensors.get("lm_head.weight")) if raw.get("original_lm_head") else None
        state = {}
        for i in range(config.medusa_num_heads):
            for layer in range(config.medusa_num_layers):
                state[f"blocks.{i}.{layer}.linear.weight"] = tensors.get(f"blocks.{i}.layers.{layer}.weight")
                bias = tensors.get(f"blocks.{i}.layers.{layer}.bias")
                state[f"blocks.{i}.{layer}.linear.bias"] = bias if bias is not None else torch.zeros(drafter.hidden_size)
            state[f"lm_heads.{i}.weight"] = shared if shared is not None else tensors.get(f"lm_heads.{i}.weight")
        load_state(drafter, state, model_dir)
        return drafter


FAMILY = Family(name="medusa", description="a Medusa checkpoint", drafter="drafters.medusa:MedusaDrafter",
                proposer_class="drafters.medusa_proposer:MedusaProposer", features=FEATURES,
                config_matches=lambda config: config.get("model_type") == "medusa",
                config_k=lambda config: config.get("num_heads", config.get("medusa_num_heads")))
"""Medusa in the registry (pyproject.toml's hsx.drafters entry point `medusa`)."""
