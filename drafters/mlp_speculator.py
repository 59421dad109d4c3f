"""IBM's MLPSpeculator (Wertheimer et al. 2024, "Accelerating Production LLMs with Combined Token/Embedding
Speculators"): n_predict small stages, each mixing the previous state with the embedding of the last token.

    MLPSpeculatorConfig     n_predict, inner_dim, tie_weights, scale_input (the HF config's names)
    MLPSpeculatorDrafter    the stages; kind "mlp_speculator": for_run / training_step / save_pretrained / ...
    FEATURES, FAMILY        what it reads from a run (layer N), MLPSpeculator in the drafter registry
    (its proposer, MLPSpeculatorProposer, is drafters/mlp_speculator_proposer.py)

Alignment (base.py): stage 0's state is the target's last-layer post-norm state of x_t and its token is x_{t+1}
(the target's own next token); stage i predicts x_{t+2+i}; stage i+1 takes stage i's state and the token after
stage i's input: the true x_{t+2+i} in training (teacher forcing), its own draft at decoding.

    s_0 = post_norm(state of x_t)                    # [.., H]  (scale_input: s_0 = ln0(s_0) / sqrt(2))
    stage i:  z = emb_i(token_i)                     # [.., D]  D = inner_dim, one table per stage
              s = proj_i(s_{i}) + z * (emb_weight / state_weight)   # proj_0: H -> D, later D -> D
              s_{i+1} = GELU(ln_i(s))                # ln: RMS normalisation with elementwise weight and bias
              logits_i = head_i(s_{i+1})             # [.., V]
    state_weight = 0.5 ** (0.5 / n_predict), emb_weight = sqrt((1 - state_weight ** 2) * D / 2)

(state_weight * proj + emb_weight * z in IBM's paper; dividing by state_weight before the scale-free norm is the same
up to its epsilon, and is how vLLM computes it, so a checkpoint decodes here as it does there.) Training: each stage's
loss is the cross-entropy to the target's next-token distribution at the position that predicts its token
(distillation; `targets="tokens"`: the run's tokens), averaged over the stages as IBM's trainer does.

Checkpoint: IBM's HF layout, which vLLM's `mlp_speculator` model class reads (vLLM 0.32's V1 engine does not serve
it: its registry entry is commented out and the model runner has no drafter for the method, docs/drafters.md
"hsx's drafters in real vLLM"; hsx's engine decodes it): config.json with model_type
"mlp_speculator", architectures ["MLPSpeculatorPreTrainedModel"], vocab_size, emb_dim (the target's hidden size),
inner_dim, n_predict, top_k_tokens_per_head, n_candidates, tie_weights, scale_input; weights emb.{i}.weight [V, D],
proj.{i}.weight [D, H or D], head.{i}.weight [V, D], ln.{i}.weight / ln.{i}.bias [D] (ln0 has no weights).
"""

from __future__ import annotations

import math
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

SQRT2 = math.sqrt(2.0)

FEATURES = Features()
"""MLPSpeculator reads layer N's state itself (its stage 0's input, through the target's final norm): no aux layers,
no top-k target."""


@dataclass(frozen=True)
class MLPSpeculatorConfig:
    """The speculator's shape (the names of IBM's HF config) and how it is trained."""

    n_predict: int = 3
    """Stages = the most drafts per step (num_speculative_tokens)."""
    inner_dim: int = 0
    """D, the width of every stage; 0 = the target's hidden size."""
    tie_weights: bool = False
    """One set of stage weights shared by stages 1.. (stage 0's projection stays its own: it reads H, not D)."""
    scale_input: bool = False
    """Normalise the target's state (weightless RMS norm, / sqrt 2) before stage 0."""
    targets: str = "target"
    """"target": the target's next-token distribution (distillation); "tokens": the run's tokens (hard labels)."""
    top_k_tokens_per_head: tuple[int, ...] | None = None
    """Candidate-tree widths written to config.json (unused by hsx and vLLM, which draft top-1); None = all 1."""
    n_candidates: int = 1
    """Candidates per sequence written to config.json (unused by hsx and vLLM)."""

    def __post_init__(self) -> None:
        if not isinstance(self.n_predict, int) or self.n_predict < 1:
            raise ValueError(f"n_predict must be an integer >= 1, got {self.n_predict!r}")
        if not isinstance(self.inner_dim, int) or self.inner_dim < 0:
            raise ValueError(f"inner_dim must be an integer >= 0 (0 = the target's hidden size), got {self.inner_dim!r}")
        if self.tie_weights and self.n_predict < 2:
            raise ValueError("tie_weights needs n_predict >= 2 (weights are tied between stages 1..n_predict-1)")
        if self.targets not in TARGETS:
            raise ValueError(f"targets must be one of {list(TARGETS)}, got {self.targets!r}")
        top_k = (1,) * self.n_predict if self.top_k_tokens_per_head is None else self.top_k_tokens_per_head
        object.__setattr__(self, "top_k_tokens_per_head", tuple(int(t) for t in top_k))
        if len(top_k) != self.n_predict:
            raise ValueError(f"top_k_tokens_per_head has {len(top_k)} entries, n_predict is {self.n_predict}")


class MLPSpeculatorLayerNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps), then (optionally) * weight + bias: the speculator's norm (no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if self.weight is None else x * self.weight + self.bias


class MLPSpeculatorDrafter(Drafter):
    """n_predict stages for a target of hidden size H (emb_dim) and vocabulary V."""

    kind: ClassVar[str] = "mlp_speculator"
    features = FEATURES

    def __init__(self, config: MLPSpeculatorConfig, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.config = config
        self.hidden_size, self.vocab_size = int(hidden_size), int(vocab_size)
        n, d = config.n_predict, config.inner_dim or int(hidden_size)
        self.inner_dim = d
        if config.tie_weights:  # the same module object at every stage (stage 0's projection aside)
            emb, proj, head, ln = nn.Embedding(vocab_size, d), nn.Linear(d, d, bias=False), \
                nn.Linear(d, vocab_size, bias=False), MLPSpeculatorLayerNorm(d)
            self.emb = nn.ModuleList([emb] * n)
            self.proj = nn.ModuleList([nn.Linear(hidden_size, d, bias=False)] + [proj] * (n - 1))
            self.head = nn.ModuleList([head] * n)
            self.ln = nn.ModuleList([ln] * n)
        else:
            self.emb = nn.ModuleList(nn.Embedding(vocab_size, d) for _ in range(n))
            self.proj = nn.ModuleList(nn.Linear(hidden_size if i == 0 else d, d, bias=False) for i in range(n))
            self.head = nn.ModuleList(nn.Linear(d, vocab_size, bias=False) for _ in range(n))
            self.ln = nn.ModuleList(MLPSpeculatorLayerNorm(d) for _ in range(n))
        self.ln0 = MLPSpeculatorLayerNorm(hidden_size, affine=False) if config.scale_input else None
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (d / 2))
        std = 1 / math.sqrt(d)  # IBM's init: N(0, 1/sqrt(D)) for embeddings and linears, norms at 1 and 0
        for module in self.modules():
            if isinstance(module, (nn.Embedding, nn.Linear)):
                nn.init.normal_(module.weight, 0.0, std)
        self.input_normalized = False
        """True when the run stored the last layer post-norm already (RunSpec.last_layer_normalized)."""
        self.last_layer_id: int | None = None
        """N, the vLLM id of the layer training reads (set by for_run; None: the batch's highest stored id)."""

    @property
    def max_drafts(self) -> int:
        return self.config.n_predict

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def for_run(cls, run_spec: Any, target: TargetHead, num_speculative_tokens: int,
                **family_options: Any) -> MLPSpeculatorDrafter:
        """n_predict = num_speculative_tokens stages; family_options: MLPSpeculatorConfig's other fields."""
        drop_draft_count(family_options, "n_predict", num_speculative_tokens, "MLPSpeculator has one stage")
        config = MLPSpeculatorConfig(n_predict=num_speculative_tokens, **family_options)
        check_run_fits(run_spec, target)
        drafter = cls(config, target.hidden_size, target.vocab_size)
        drafter.input_normalized = bool(getattr(run_spec, "last_layer_normalized", False))
        drafter.last_layer_id = int(run_spec.num_hidden_layers)
        return drafter

    # -- the model ---------------------------------------------------------------------------------------------
    def initial_state(self, post_norm: torch.Tensor) -> torch.Tensor:
        """[..., H] the target's post-norm state -> stage 0's input state."""
        x = post_norm.to(self.proj[0].weight.dtype)
        return self.ln0(x) / SQRT2 if self.ln0 is not None else x

    def mix(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Stage i's state: state [..., H or D] and tokens [...] (the token before the one it predicts) -> [..., D]."""
        z = self.emb[i](tokens)  # [..., D]
        s = self.proj[i](state) + z * (self.emb_weight / self.state_weight)
        return F.gelu(self.ln[i](s))

    def stage(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage i: (its state [..., D], its logits [..., V])."""
        s = self.mix(i, state, tokens)
        return s, self.head[i](s)

    def forward(self, post_norm: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: post_norm [..., H], tokens [..., n] (stage i's input token; n <= n_predict) -> logits
        [n, ..., V]. With tokens[..., 0] = x_{t+1} and tokens[..., i] = x_{t+1+i}, logits[i] scores x_{t+2+i}."""
        state = self.initial_state(post_norm)
        out = []
        for i in range(tokens.shape[-1]):
            state, logits = self.stage(i, state, tokens[..., i])
            out.append(logits)
        return torch.stack(out)

    def recomputable(self) -> list[nn.Module]:
        """--gradient-checkpointing: every stage's layer norm (its [.., D] activations are the stage's largest)."""
        return list(dict.fromkeys(self.ln))

    # -- training ----------------------------------------------------------------------------------------------
    def training_step(self, batch: DrafterBatch, target: TargetHead) -> StepResult:
        n = self.config.n_predict
        last = batch.layer(self.last_layer_id or max(batch.layer_ids))  # [R, S, H] the stored last layer
        dtype = self.proj[0].weight.dtype
        with torch.no_grad():
            post = last.to(dtype) if self.input_normalized else target.post_norm(last).to(dtype)  # [R, S, H]
        teacher = TeacherLogits.of(batch, post, target, self.memory.ce_chunk_tokens)
        state = self.initial_state(post)  # [R, S, H] stages run over every position, teacher forced
        losses = []
        correct = torch.zeros(n, dtype=torch.long)
        counted = torch.zeros(n, dtype=torch.long)
        for i in range(n):
            state = self.mix(i, state, batch.shifted(batch.input_ids, 1 + i))  # [R, S, D] fed x_{t+1+i}
            mask = predicted_mask(batch, 2 + i)  # [R, S] x_{t+2+i} trained and in x_t's sample
            rows, cols = mask.nonzero(as_tuple=True)  # [n_i]
            where = teacher.rows(rows, cols + 1 + i)  # the target's logits for x_{t+2+i}
            mean, best = head_loss(state[rows, cols], self.head[i], teacher.distribution(where),
                                   batch.input_ids[rows, cols + 2 + i], self.config.targets,
                                   self.memory.ce_chunk_tokens)  # head i's [n_i, V] logits
            losses.append(mean)
            correct[i] = int((best == teacher.greedy[where]).sum())
            counted[i] = rows.numel()
        return StepResult(torch.stack(losses).mean(), correct, counted)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str, *, verifier: str) -> None:
        c = self.config
        config = {
            "model_type": "mlp_speculator", "architectures": ["MLPSpeculatorPreTrainedModel"],
            "vocab_size": self.vocab_size, "emb_dim": self.hidden_size, "inner_dim": self.inner_dim,
            "n_predict": c.n_predict,
            "top_k_tokens_per_head": list(c.top_k_tokens_per_head),
            "n_candidates": c.n_candidates, "tie_weights": c.tie_weights, "scale_input": c.scale_input,
            "torch_dtype": str(self.head[0].weight.dtype).removeprefix("torch."),
            "hsx": {"kind": self.kind, "verifier": verifier, "targets": c.targets},
        }
        tensors = {}
        for i in range(c.n_predict):
            tensors[f"emb.{i}.weight"] = self.emb[i].weight  # [V, D]
            tensors[f"proj.{i}.weight"] = self.proj[i].weight  # [D, H] (i = 0) or [D, D]
            tensors[f"head.{i}.weight"] = self.head[i].weight  # [V, D]
            tensors[f"ln.{i}.weight"] = self.ln[i].weight  # [D]
            tensors[f"ln.{i}.bias"] = self.ln[i].bias  # [D]
        write_checkpoint(out_dir, config, tensors)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> MLPSpeculatorDrafter:
        raw = read_config(model_dir, "mlp_speculator")
        hsx = raw.get("hsx") or {}
        try:
            config = MLPSpeculatorConfig(
                n_predict=int(raw["n_predict"]), inner_dim=int(raw.get("inner_dim", 0)),
                tie_weights=bool(raw.get("tie_weights", False)), scale_input=bool(raw.get("scale_input", False)),
                targets=hsx.get("targets", "target"), top_k_tokens_per_head=raw.get("top_k_tokens_per_head"),
                n_candidates=int(raw.get("n_candidates", 1)))
            drafter = cls(config, int(raw["emb_dim"]), int(raw["vocab_size"]))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{model_dir}/config.json is not an MLPSpeculator config hsx can load ({e})") from e
        tensors = {k.removeprefix("speculator."): v for k, v in read_tensors(model_dir).items()}
        names = set(drafter.state_dict())  # with tie_weights every stage's name is there, holding the same tensor
        state = {name: tensors.get(name) for name in names}
        if config.tie_weights:  # IBM's tied checkpoints may store only the first stage's copy
            for name in names:
                first = name.split(".")
                first[1] = "1" if first[0] == "proj" else "0"
                state[name] = state[name] if state[name] is not None else tensors.get(".".join(first))
        load_state(drafter, state, model_dir)
        return drafter


FAMILY = Family(name="mlp_speculator", description="an MLPSpeculator checkpoint",
                drafter="drafters.mlp_speculator:MLPSpeculatorDrafter",
                proposer_class="drafters.mlp_speculator_proposer:MLPSpeculatorProposer", features=FEATURES,
                config_matches=lambda config: config.get("model_type") == "mlp_speculator",
                config_k=lambda config: config.get("n_predict"))
"""MLPSpeculator in the registry (pyproject.toml's hsx.drafters entry point `mlp_speculator`)."""
