"""DSpark (DeepSpec; speculators' `dspark`): DFlash's block drafter with every slot drafting (sample_from_anchor), a
low-rank Markov head that corrects each slot's logits by the token drafted before it, and a confidence head that
estimates each draft's chance of acceptance (decoding may stop a block where it falls).

    DSparkConfig     DFlash's options + markov_rank, markov_head_type, the confidence head, loss weights, threshold
    MarkovHead       e_k = W1[prev_k] (r = markov_rank);  vanilla: bias_k = W2 e_k;  gated: bias_k = W2 (sigmoid(
                     gate_proj([h_k ; e_k])) * e_k);  rnn: [g, c, o] = joint_proj([s_{k-1} ; e_k ; h_k]),
                     s_k = g * s_{k-1} + (1 - g) * tanh(c), bias_k = W2 tanh(o) (state reset per block)
    ConfidenceHead   c_k = sigmoid(proj([h_k ; W1[prev_k]]))  (or proj(h_k) without the Markov embedding)
    DSparkDrafter    the model (Drafter kind "dspark"); DFlashDrafter's backbone, attention and context
    FEATURES, FAMILY DSpark in the drafter registry (its proposer: drafters/dspark_proposer.py)

Alignment (DFlash's, with sample_from_anchor): a block anchored at a holds x_a in slot 0 and the mask token in slots
1..B-1 at positions a..a+B-1, sees its document's context before a, and slot k drafts x_{a+k+1}: B drafts per block.
h_k = norm(backbone output of slot k); base_k = lm_head(h_k); logits_k = base_k + bias_k, prev_k = the token before
slot k's draft (x_{a+k}: the anchor for slot 0; in training the corpus token, teacher-forced; in decoding the previous
draft).

Training (DeepSpec's weights 0.1 / 0.9 / 1.0): anchors as DFlash's; slot k is trained when x_{a+k+1} is in a's
document and loss-masked, weight w_k = exp(-k / gamma); q_k = softmax(logits_k), p_k = the target's distribution of
x_{a+k+1} (TargetHead on layer N at a+k, or a stored top-K). The CE term is against p_k itself (hsx's families all
learn the target's distribution; DeepSpec takes the data token, speculators the target's argmax):
    loss = ce_weight * sum w CE(q, p) / sum w + tv_weight * sum w TV(q, p) / sum w
           + confidence_weight * sum w BCE(c_k, 1 - TV(q_k, p_k)) / sum w     (the target detached)
Decoding (drafters/dspark_proposer.py): one backbone forward per block, then the Markov correction slot by slot (each
draft conditions the next); with confidence_threshold > 0 a block stops before the first slot whose c_k is below it
(DeepSpec's per-position test; 0 = off, DeepSpec's default).

Checkpoint (speculators' DSparkDraftModel layout): DFlash's config.json with speculators_model_type "dspark",
architectures ["DSparkSpeculator"], sample_from_anchor true, markov_rank, markov_head_type, enable_confidence_head,
confidence_head_with_markov, speculative_tokens = k (B by default); weights DFlash's + markov_head.markov_w1 [V, r],
markov_head.markov_w2 [V, r], (gated: markov_head.gate_proj [r, H + r] + bias; rnn: markov_head.joint_proj [3r, 2r + H]
+ bias), confidence_head.proj [1, H (+ r)] + bias. Embeddings and lm_head are the target's, never written (speculators
reloads them from the verifier it names); hsx drafts in the whole vocabulary (no d2t / t2d).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import (
    DrafterBatch,
    StepResult,
    TargetHead,
    speculators_num_speculative_tokens,
    topk_distribution,
)
from drafters.dflash import FEATURES, DFlashConfig, DFlashDrafter, check_block_attention
from drafters.registry import Family

SPECULATORS_MODEL_TYPE = "dspark"
ARCHITECTURE = "DSparkSpeculator"
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """DSpark's options (`hsx train-drafter --kind dspark --family-options '{"markov_head_type": "gated"}'`)."""

    num_layers: int = 1
    """Draft decoder layers (speculators' DSpark default 1; DeepSpec's released checkpoints 5)."""
    markov_rank: int = 256
    """r, the rank of the Markov head's token transition (W1 [V, r], W2 [V, r]); 0 = no Markov head (DFlash's
    logits with every slot drafting)."""
    markov_head_type: str = "vanilla"
    """"vanilla" (bias = W2 W1[prev]), "gated" (W1[prev] gated by the slot's state) or "rnn" (a gated state over the
    block); vLLM serves vanilla only."""
    enable_confidence_head: bool = True
    """Train the confidence head (each slot's chance of acceptance, for early stopping)."""
    confidence_head_with_markov: bool = True
    """The confidence head reads W1[prev] beside the slot's state (needs markov_rank > 0)."""
    ce_weight: float = 0.1
    """Weight of the cross-entropy against the target's distribution (DeepSpec / speculators: 0.1)."""
    tv_weight: float = 0.9
    """Weight of the total-variation distance to the target's distribution (0.9)."""
    confidence_weight: float = 1.0
    """Weight of the confidence head's BCE against 1 - TV (1.0)."""
    confidence_threshold: float = 0.0
    """Decoding: stop a block before the first slot whose confidence is below this (0 = never: every slot drafts)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type {self.markov_head_type!r}: choose one of {list(MARKOV_HEAD_TYPES)}")
        if self.enable_confidence_head and self.confidence_head_with_markov and not self.markov_rank:
            raise ValueError("confidence_head_with_markov needs a Markov head (markov_rank > 0); set it false")
        if min(self.ce_weight, self.tv_weight, self.confidence_weight) < 0 or not self.ce_weight + self.tv_weight > 0:
            raise ValueError("ce_weight, tv_weight and confidence_weight must be >= 0, ce_weight + tv_weight > 0")
        if not 0 <= self.confidence_threshold < 1:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {self.confidence_threshold}")


class MarkovHead(nn.Module):
    """The low-rank correction of slot k's logits by the token before it (see the module docstring)."""

    def __init__(self, vocab: int, rank: int, hidden: int, kind: str) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def step_inputs(self, e: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot: e = W1[prev] [..., r], h [..., H], the rnn state before it -> (the r-vector W2 reads, the state
        after it)."""
        if self.kind == "vanilla":
            return e, None
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e, None
        state = torch.zeros_like(e) if state is None else state
        g, c, o = self.joint_proj(torch.cat([state, e, h], -1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        return torch.tanh(o), g * state + (1 - g) * torch.tanh(c)

    def bias(self, prev: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Teacher-forced over whole blocks: prev [..., B] ids, h [..., B, H] -> [..., B, V] (rnn: slot by slot)."""
        e = self.embed(prev)
        if self.kind != "rnn":
            return self.markov_w2(self.step_inputs(e, h, None)[0])
        state, outs = None, []
        for k in range(prev.shape[-1]):
            x, state = self.step_inputs(e[..., k, :], h[..., k, :], state)
            outs.append(x)
        return self.markov_w2(torch.stack(outs, dim=-2))


class ConfidenceHead(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[..., width] -> [...] the logit of the slot's acceptance probability."""
        return self.proj(features).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """The DSpark block drafter (see the module docstring)."""

    kind = "dspark"
    features = FEATURES
    label_offset: ClassVar[int] = 1

    def __init__(self, config: DSparkConfig, layer_config, aux_layer_ids, target: TargetHead,
                 num_speculative_tokens: int | None = None, verifier: str = "", verifier_architectures=()) -> None:
        super().__init__(config, layer_config, aux_layer_ids, target, num_speculative_tokens or config.block_size,
                         verifier, verifier_architectures)
        h, vocab = layer_config.hidden_size, layer_config.vocab_size
        self.markov_head = MarkovHead(vocab, config.markov_rank, h, config.markov_head_type) \
            if config.markov_rank else None
        width = h + (config.markov_rank if config.confidence_head_with_markov and config.markov_rank else 0)
        self.confidence_head = ConfidenceHead(width) if config.enable_confidence_head else None

    # -- the heads ----------------------------------------------------------------------------------------------
    def corrected(self, out: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced whole blocks: backbone outputs out [..., B, H], prev [..., B] the token before each slot's
        draft -> (logits [..., B, V] = base + Markov bias, confidence logits [..., B] or None)."""
        h = self.norm(out)
        logits = h @ self.target_lm_head.to(h.dtype).T
        if self.markov_head is not None:
            logits = logits + self.markov_head.bias(prev, h)
        return logits, self.confidence(h, prev)

    def confidence(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """h [..., H] normed slot states, prev [...] -> [...] confidence logits (None without the head)."""
        if self.confidence_head is None:
            return None
        if self.config.confidence_head_with_markov and self.markov_head is not None:
            h = torch.cat([h, self.markov_head.embed(prev).to(h.dtype)], -1)
        return self.confidence_head(h)

    # -- training -----------------------------------------------------------------------------------------------
    def training_step(self, batch: DrafterBatch, target: TargetHead) -> StepResult:
        b_size, cfg = self.block_size, self.config
        r, s = batch.input_ids.shape
        dev = batch.input_ids.device
        ok = self._anchor_ok(batch)
        n = min(cfg.max_anchors, max(1, int(ok.sum(-1).max())))
        score = torch.rand((r, s), device=dev).masked_fill(~ok, 2.0)
        anchors = score.topk(n, dim=-1, largest=False).indices.sort(-1).values  # [R, n]
        out, labels, trained = self.anchored_blocks(batch, anchors, ok)
        correct = torch.zeros(b_size, dtype=torch.long)
        counted = torch.zeros(b_size, dtype=torch.long)
        rows, blk, slot = trained.nonzero(as_tuple=True)
        if not rows.numel():
            return StepResult(out.sum() * 0.0, correct, counted)
        # the token before each slot's draft: x_{a+k} (slot 0: the anchor), teacher-forced
        prev = batch.input_ids.gather(1, (labels - 1).flatten(1)).view(labels.shape)  # [R, n, B]
        # only the blocks that train run the heads: which[i] = the block of trained slot i among them
        blocks, which = torch.unique(rows * anchors.shape[1] + blk, return_inverse=True)
        b_rows, b_blk = blocks // anchors.shape[1], blocks % anchors.shape[1]
        logits, conf = self.corrected(out[b_rows, b_blk], prev[b_rows, b_blk])  # [M', B, V], [M', B]
        q_logits = logits[which, slot].float()  # [M, V]
        at = labels[rows, blk, slot] - 1  # the target's distribution of x_{a+k+1}: at a+k
        with torch.no_grad():
            if batch.target_topk is not None:
                ids, logprobs = (t[rows, at] for t in batch.target_topk)
                p = topk_distribution(ids, logprobs, torch.arange(q_logits.shape[-1], device=dev), q_logits.shape[-1])
                greedy = ids[:, 0]
            else:
                p = torch.softmax(target.logits(batch.layer(max(batch.layer_ids))[rows, at]).float(), -1)
                greedy = p.argmax(-1)
        weight = torch.exp(-slot.float() / cfg.gamma)
        log_q = F.log_softmax(q_logits, -1)
        q = log_q.exp()
        tv = 0.5 * (q - p).abs().sum(-1)  # [M]
        ce = -(p * log_q).sum(-1)
        norm = weight.sum()
        loss = (cfg.ce_weight * (weight * ce).sum() + cfg.tv_weight * (weight * tv).sum()) / norm
        if conf is not None and cfg.confidence_weight:
            c = conf[which, slot].float()
            bce = F.binary_cross_entropy_with_logits(c, (1 - tv).detach().clamp(0, 1), reduction="none")
            loss = loss + cfg.confidence_weight * (weight * bce).sum() / norm
        with torch.no_grad():
            hit = q_logits.argmax(-1) == greedy
            for k in range(b_size):
                sel = slot == k
                counted[k] = int(sel.sum())
                correct[k] = int((hit & sel).sum())
        return StepResult(loss, correct, counted)

    def recomputable(self) -> list[nn.Module]:
        return list(self.layers)

    # -- checkpoint (speculators' dspark layout) ------------------------------------------------------------------
    def checkpoint_config(self) -> dict[str, Any]:
        doc = super().checkpoint_config()
        cfg = self.config
        doc.pop("hsx_dflash")
        doc.update(architectures=[ARCHITECTURE], speculators_model_type=SPECULATORS_MODEL_TYPE, sample_from_anchor=True,
                   markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
                   enable_confidence_head=cfg.enable_confidence_head,
                   confidence_head_with_markov=bool(cfg.confidence_head_with_markov and cfg.markov_rank))
        doc["speculators_config"]["algorithm"] = SPECULATORS_MODEL_TYPE
        doc["hsx_dspark"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}
        return doc

    checkpoint_type: ClassVar[str] = SPECULATORS_MODEL_TYPE
    config_class: ClassVar[type] = DSparkConfig
    options_key: ClassVar[str] = "hsx_dspark"

    @classmethod
    def check_checkpoint(cls, model_dir: str, doc: dict[str, Any]) -> None:
        check_block_attention(model_dir, doc)
        if doc.get("sample_from_anchor") is False:
            raise ValueError(f"{model_dir}: sample_from_anchor=false; hsx's DSpark drafts from every slot (slot k "
                             "predicts x_{a+k+1}), as DeepSpec and speculators' default")

    @classmethod
    def checkpoint_options(cls, doc: dict[str, Any]) -> dict[str, Any]:
        """The heads as speculators' config.json states them (another tool's checkpoint has no hsx_dspark)."""
        return dict(markov_rank=int(doc.get("markov_rank", 256)),
                    markov_head_type=doc.get("markov_head_type", "vanilla"),
                    enable_confidence_head=bool(doc.get("enable_confidence_head", True)),
                    confidence_head_with_markov=bool(doc.get("confidence_head_with_markov", True)))


FAMILY = Family(name="dspark", description="a DSpark (DeepSpec; speculators dspark) block-drafter checkpoint",
                drafter="drafters.dspark:DSparkDrafter", proposer_class="drafters.dspark_proposer:DSparkProposer",
                config_matches=lambda config: config.get("speculators_model_type") == SPECULATORS_MODEL_TYPE,
                config_k=speculators_num_speculative_tokens, parallel=True,
                options=(), features=FEATURES)
"""DSpark in the registry (pyproject.toml's hsx.drafters entry point `dspark`)."""
