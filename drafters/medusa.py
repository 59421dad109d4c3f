"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"):
K heads on the target's last post-norm state, each `medusa_num_layers` residual blocks then its own lm_head.

    MedusaConfig            medusa_num_heads (K), medusa_num_layers (ModelOpt's names), loss weighting
    MedusaDrafter           the heads; kind "medusa": for_run / training_step / save_pretrained / from_pretrained
    MedusaProposer          drafts k tokens per row from the newest observed state (speculative_config method "medusa")
    predicted_mask, TeacherLogits, head_loss   which positions a draft trains on, the target's logits there, the loss
    LastStateProposer       the proposers' shared part: the newest verified state per row
    (mlp_speculator.py reuses these helpers and the checkpoint file helpers at the end)

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
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import WEIGHTS_NAME, Drafter, DrafterBatch, StepResult, TargetHead, write_checkpoint
from drafters.registry import Family
from extractor.proposers import Draft, Proposer
from extractor.sampling import sample_with_probs

TARGETS = ("target", "tokens")


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
    def required_layer_ids(cls, num_hidden_layers: int, config: Any = None) -> tuple[int, ...]:
        return (int(num_hidden_layers),)  # the last decoder layer; its post-norm state is what the heads read

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

    # -- training ----------------------------------------------------------------------------------------------
    def training_step(self, batch: DrafterBatch, target: TargetHead) -> StepResult:
        last = batch.layer(self.last_layer_id or max(batch.layer_ids))  # [R, S, H] the stored last layer
        dtype = self.lm_heads[0].weight.dtype
        with torch.no_grad():
            post = last.to(dtype) if self.input_normalized else target.post_norm(last).to(dtype)  # [R, S, H]
        teacher = TeacherLogits.of(batch, post, target)
        weights = [self.config.medusa_decay_coefficient ** j for j in range(self.num_heads)]
        loss = post.new_zeros(())
        correct = torch.zeros(self.num_heads, dtype=torch.long)
        counted = torch.zeros(self.num_heads, dtype=torch.long)
        for j in range(self.num_heads):
            mask = predicted_mask(batch, 2 + j)  # [R, S] x_{t+2+j} is trained and in x_t's sample
            rows, cols = mask.nonzero(as_tuple=True)  # [n_j]
            logits = self.lm_heads[j](self.blocks[j](post[rows, cols]))  # [n_j, V]
            soft = teacher.at(rows, cols + 1 + j)  # [n_j, V] the target's logits for x_{t+2+j}
            loss = loss + weights[j] * head_loss(logits, soft, batch.input_ids[rows, cols + 2 + j],
                                                 self.config.targets)
            correct[j] = int((logits.argmax(-1) == soft.argmax(-1)).sum())
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


def predicted_mask(batch: DrafterBatch, shift: int) -> torch.Tensor:
    """[R, S] bool: the token `shift` after x_t is in x_t's sample and has loss_mask 1 (what a draft at t trains on)."""
    return batch.same_document(shift) & batch.shifted(batch.loss_mask, shift, False)


@dataclass
class TeacherLogits:
    """The target's logits at the positions whose next token is trained (the only ones a draft's target is read
    from), not [R, S, V] for the whole batch."""

    logits: torch.Tensor  # [n, V] float32
    index: torch.Tensor  # [R, S] int64: row of `logits` for position (r, s), -1 where none was computed

    @classmethod
    def of(cls, batch: DrafterBatch, post: torch.Tensor, target: TargetHead) -> TeacherLogits:
        """post [R, S, H] the target's post-norm last state of every position."""
        needed = predicted_mask(batch, 1)  # [R, S] x_{s+1} trained and in x_s's sample
        index = torch.full(needed.shape, -1, dtype=torch.long, device=needed.device)
        index[needed] = torch.arange(int(needed.sum()), device=needed.device)
        with torch.no_grad():
            logits = (post[needed] @ target.lm_head.to(post.device, post.dtype).T).float()  # [n, V]
        return cls(logits, index)

    def at(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """[m, V] the target's logits at positions (rows[i], cols[i]) (each one whose next token is trained)."""
        index = self.index[rows, cols]
        assert bool((index >= 0).all()), "a draft target read at a position whose next token is not trained"
        return self.logits[index]


def head_loss(logits: torch.Tensor, teacher: torch.Tensor, tokens: torch.Tensor, targets: str) -> torch.Tensor:
    """Mean over n positions of one draft's loss: logits [n, V] against the target's logits [n, V] (soft labels:
    cross-entropy to softmax(teacher), = KL up to the teacher's entropy) or the tokens [n] (hard labels)."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0  # keeps the graph; nothing to learn from this draft position
    logp = F.log_softmax(logits.float(), dim=-1)
    if targets == "tokens":
        return F.nll_loss(logp, tokens)
    return -(F.softmax(teacher, dim=-1) * logp).sum(-1).mean()


def drop_draft_count(options: dict[str, Any], key: str, k: int, family_has: str) -> None:
    """Remove `key` (the family's own name for its number of drafts) from `options`: ValueError unless it equals
    num_speculative_tokens `k`, which the config is then built from."""
    given = options.pop(key, k)
    if given != k:
        raise ValueError(f"{key}={given} and num_speculative_tokens={k} disagree; {family_has} per draft: pass only "
                         "num_speculative_tokens")


def check_run_fits(run_spec: Any, target: TargetHead) -> None:
    """The run's states must come from a model of the target's width (else the run is from another model)."""
    hidden = getattr(run_spec, "hidden_size", None)
    if hidden is not None and int(hidden) != target.hidden_size:
        raise ValueError(f"the run's states are {hidden} wide but the target's lm_head is {target.hidden_size}: the "
                         f"run was extracted from another model than the target given (--model)")


# -- checkpoint files (shared with mlp_speculator.py) ------------------------------------------------------------
def read_config(model_dir: str, model_type: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {model_dir!r}; pass the folder save_pretrained wrote")
    with open(path) as f:
        raw = json.load(f)
    if raw.get("model_type") != model_type:
        raise ValueError(f"{path} has model_type {raw.get('model_type')!r}, not {model_type!r}: this folder holds "
                         "another kind of checkpoint (check the speculative method)")
    return raw


def read_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = os.path.join(model_dir, WEIGHTS_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {model_dir!r}")
    return load_file(path)


def load_state(module: nn.Module, state: dict[str, torch.Tensor | None], model_dir: str) -> None:
    """Load `state` (module names) into `module`, naming any checkpoint tensor that is missing or misshaped."""
    missing = sorted(k for k, v in state.items() if v is None)
    if missing:
        raise ValueError(f"{model_dir}/{WEIGHTS_NAME} lacks tensors for {missing[:4]}{'...' if len(missing) > 4 else ''}"
                         "; the checkpoint does not match its config.json")
    own = module.state_dict()
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(f"{model_dir}/{WEIGHTS_NAME}: {name} has shape {tuple(tensor.shape)}, its config.json "
                             f"says {tuple(own[name].shape)}")
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=True)


# -- decoding ------------------------------------------------------------------------------------------------------
def load_for_runner(cls, model_dir: str, runner, num_speculative_tokens: int):
    """A drafter checkpoint checked against the target `runner` holds, on its device and dtype, and its final norm."""
    from extractor.norm import FinalNorm

    drafter = cls.from_pretrained(model_dir)
    if drafter.hidden_size != runner.hidden_size or drafter.vocab_size != runner.vocab_size:
        raise ValueError(f"the {cls.kind} drafter {model_dir} has hidden size {drafter.hidden_size} and vocabulary "
                         f"{drafter.vocab_size}, the target {runner.config.model} has {runner.hidden_size} and "
                         f"{runner.vocab_size}: it was trained for another model; train one on a run of this target")
    if not 1 <= num_speculative_tokens <= drafter.max_drafts:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} but the {cls.kind} drafter {model_dir} "
                         f"drafts 1 to {drafter.max_drafts} tokens; lower num_speculative_tokens or train a drafter "
                         "with more heads / stages")
    norm = FinalNorm.of_model(runner.model)  # the target's own, in its dtype on its device: nothing read or copied
    return drafter.to(runner.device, runner.dtype).eval().requires_grad_(False), norm


class LastStateProposer(Proposer):
    """A proposer that drafts from the newest verified state of each row: the target's last layer (pre-norm,
    observed), put through the target's final norm (`self.norm`). propose() picks the rows to draft for and hands
    their post-norm states to the subclass's `draft_steps`, then cuts each row's draft to its own k."""

    drafter_class: type
    """The Drafter subclass its checkpoints hold."""

    def __init__(self, model_dir: str, runner, num_speculative_tokens: int) -> None:
        self.drafter, self.norm = load_for_runner(self.drafter_class, model_dir, runner, num_speculative_tokens)
        self.capture_layer_ids = (int(runner.num_hidden_layers),)
        self.k = num_speculative_tokens
        self.device = runner.device
        self.rows: list[torch.Tensor | None] = []

    def start(self, contexts) -> None:
        self.rows = [None] * len(contexts)

    def join(self, contexts) -> None:
        self.rows += [None] * len(contexts)

    def observe(self, states) -> None:
        if len(states) != len(self.rows):
            raise RuntimeError(f"observe got states of {len(states)} rows, the batch has {len(self.rows)}")
        for b, s in enumerate(states):  # s: [n_b, 1, H]
            if s.shape[0]:
                self.rows[b] = s[-1, 0]

    def select(self, keep) -> None:
        self.rows = [self.rows[i] for i in keep]

    @torch.inference_mode()
    def propose(self, contexts, ks, params, generators):
        if len(contexts) != len(self.rows):
            raise RuntimeError(f"propose got {len(contexts)} rows, the proposer holds {len(self.rows)}: the engine "
                               "must call start/join/select for every change of its rows")
        rows = [b for b, k in enumerate(ks) if k > 0 and self.rows[b] is not None]  # asked, and with a state
        drafts = [Draft([]) for _ in contexts]
        if not rows:
            return drafts
        k_max = min(max(ks[b] for b in rows), self.k)
        x = self.norm(torch.stack([self.rows[b] for b in rows]))  # [B', H] post-norm
        steps = self.draft_steps(x, [contexts[b][-1] for b in rows], k_max, [params[b] for b in rows],
                                 [generators[b] for b in rows])
        for r, b in enumerate(rows):
            k = min(ks[b], k_max)
            q = [steps[j][1][r] for j in range(k)]
            drafts[b] = Draft([steps[j][0][r] for j in range(k)], torch.stack(q) if q[0] is not None else None)
        return drafts

    def draft_steps(self, x: torch.Tensor, last_tokens: list[int], k: int, params: Sequence, generators: Sequence
                    ) -> list[tuple[list[int], list]]:
        """k draft positions for rows with post-norm states x [B', H] and newest tokens `last_tokens`: per
        position, extractor.sampling.sample_with_probs' (tokens, probs) over the rows."""
        raise NotImplementedError


class MedusaProposer(LastStateProposer):
    """speculative_config method "medusa": head j's choice from the newest verified state is draft j.

    The engine observes the last layer (pre-norm); the newest observed state is that of contexts[b][-2], whose
    heads predict the tokens after contexts[b][-1] (the target's own token). A row with no observed state yet
    (a one-token prompt) gets no draft."""

    drafter_class = MedusaDrafter

    def draft_steps(self, x, last_tokens, k, params, generators):
        logits = self.drafter(x, k)  # [k, B', V]: every head reads the same state
        return [sample_with_probs(logits[j], params, generators) for j in range(k)]


FAMILY = Family(name="medusa", description="a Medusa checkpoint", drafter="drafters.medusa:MedusaDrafter",
                proposer_class="drafters.medusa:MedusaProposer",
                config_matches=lambda config: config.get("model_type") == "medusa",
                config_k=lambda config: config.get("num_heads", config.get("medusa_num_heads")))
"""Medusa in the registry (pyproject.toml's hsx.drafters entry point `medusa`)."""
