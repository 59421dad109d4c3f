"""DFlash (speculators' `dflash`): a block drafter. One forward drafts a whole block of tokens from the fused aux-layer
context, the block's slots attending to each other both ways.

    DFlashConfig     block_size, depth, anchors per row, slot weighting, mask token
    DFlashDrafter    the model (Drafter kind "dflash"):
        fc            [H, A*H]   fuses the aux layers' states of each context token, then hidden_norm: the context
        layers        Qwen3-style decoder layers (q_norm / k_norm); each projects the CONTEXT with its own k/v and
                      attends over [context before the anchor ; the block] (the block bidirectional inside)
        norm          final RMSNorm; read out with the target's lm_head and embeddings (frozen, never written)
    FEATURES, FAMILY what it reads from a run (aux layers; N or a top-k target), DFlash in the drafter registry
    (its proposer, DFlashProposer, is drafters/dflash_proposer.py: per step one forward over the block [x_T, mask x
    (block_size-1)] at positions T..T+block_size-1 against the cached context keys of x_0..x_{T-1}; slot j drafts
    x_{T+j})

Alignment (base.py's): the context entry of position p is the fused aux states of x_p (what the target computed after
reading x_p). A block anchored at a holds x_a in slot 0 and the mask token in slots 1..B-1, at positions a..a+B-1; it
sees the context of positions < a of its document (what decoding has: the target has not computed x_a's state when
x_a is the newest token). Slot j >= 1 predicts x_{a+j} (speculators' sample_from_anchor=false): num_speculative_tokens
= block_size - 1 by default.

Training (speculators' recipe): per packed row up to `max_anchors` anchors drawn at random among positions whose next
token is trained and in the same document; every slot j >= 1 whose token x_{a+j} is trained and in a's document is
trained against the target's distribution of x_{a+j} (TargetHead on layer N at a+j-1; or the stored top-K), weight
exp(-(j-1)/gamma) (gamma 4), cross-entropy.

Checkpoint (what speculators' DFlashDraftModel.from_pretrained loads): config.json with speculators_model_type
"dflash", architectures ["DFlashSpeculator"], transformer_layer_config (a Qwen3 config dict: num_hidden_layers = the
draft's depth, vocab_size = the target's), draft_vocab_size (= the target's vocabulary: hsx drafts in the whole
vocabulary, so no lm_head, d2t or t2d is written, as speculators omits them then), block_size,
aux_hidden_state_layer_ids, mask_token_id, sliding_window_non_causal true, sample_from_anchor false, target_hidden_size,
speculators_config (algorithm "dflash", greedy proposal of block_size-1 tokens, the verifier); weights fc,
hidden_norm, layers.N.self_attn.{q,k,v,o}_proj, .{q,k}_norm, layers.N.mlp.*, layers.N.{input,post_attention}_layernorm,
norm. sliding_window_non_causal is true because the block attends both ways: speculators makes a layer without a
sliding window non-causal either way, but vLLM (0.32, configs/speculators/algos.py) turns the key into
dflash_config.causal = not sliding_window_non_causal for every layer, so false would make vLLM draft causally.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from drafters.attention import Layout, ranged_attention
from drafters.base import (
    WEIGHTS_NAME,
    Drafter,
    DrafterBatch,
    StepResult,
    TargetHead,
    load_weights,
    read_checkpoint_json,
    resolve_mask_token_id,
    speculators_num_speculative_tokens,
    target_folder,
    topk_distribution,
    verifier_head,
)
from drafters.features import Features, aux_layers_for_run
from drafters.llama_layers import llama_layer_config
from drafters.memory import chunked_argmax, cross_entropy, softmax_of
from drafters.registry import Family

SPECULATORS_MODEL_TYPE = "dflash"
ARCHITECTURE = "DFlashSpeculator"

FEATURES = Features(aux_layers=3, top_k=True)
"""DFlash builds its context from aux layers (three proposed for extraction, unless aux_layer_ids says) and reads
layer N only as its teacher's distribution, which a top-k target can stand in for."""


@dataclass(frozen=True)
class DFlashConfig:
    """DFlash's options (`hsx train-drafter --kind dflash --family-options '{"block_size": 8}'`)."""

    block_size: int = 8
    """Slots per block: the anchor and block_size - 1 mask slots, each drafting one token."""
    num_layers: int = 2
    """Draft decoder layers (the mask slots differ only by position: one layer leaves them little to work with; the
    tiny-target tests reach AL >= 2 with two, not with one)."""
    max_anchors: int = 512
    """Blocks per packed row per step, at most (speculators' default; fewer where a row has fewer trained
    positions)."""
    gamma: float = 4.0
    """Slot j's loss weight is exp(-(j-1)/gamma)."""
    mask_token_id: int | None = None
    """The token of the mask slots (None: the target's pad token, else its last vocabulary id)."""
    aux_layer_ids: tuple[int, ...] | None = None
    """vLLM ids of the fused layers; None = every stored layer of the run but N."""
    intermediate_size: int | None = None
    """MLP width of the draft layers; None = the target's."""

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (an anchor and at least one drafted slot), got {self.block_size}")
        if self.num_layers < 1 or self.max_anchors < 1 or not self.gamma > 0:
            raise ValueError("num_layers and max_anchors must be >= 1 and gamma > 0")
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: x [R, heads, N, d], cos/sin [R, N, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from [context ; block], each projected by this layer (Qwen3 q/k norms)."""

    def __init__(self, config) -> None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R, N, H] -> k, v [R, kv_heads, N, d] (k normed and rotated at its positions)."""
        r, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(r, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(r, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], context_kv, mask) -> torch.Tensor:
        """x [R, Q, H] the (normed) block slots at rope's positions; context_kv (k, v) [R, kv_heads, C, d]; mask: a
        BlockLayout (training: blocks over packed rows, ranged attention) or a bool [R, 1, Q, C + Q] (decoding) ->
        [R, Q, H]."""
        r, q_len, _ = x.shape
        cos, sin = rope
        q = self.q_norm(self.q_proj(x).view(r, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = _rotate(q, cos, sin)
        k_blk, v_blk = self.keys_values(x, cos, sin)
        if isinstance(mask, BlockLayout):
            out = mask.attend(q, k_blk, v_blk, context_kv)
            return self.o_proj(out.reshape(r, q_len, -1))
        k = torch.cat([context_kv[0], k_blk], dim=2)
        v = torch.cat([context_kv[1], v_blk], dim=2)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(r, q_len, -1))


@dataclass
class BlockLayout:
    """The training forward's attention: blocks of `block` slots anchored in packed rows, each slot seeing the
    context of its anchor's document before the anchor (drafters.attention's ranged attention, no dense mask) and
    its own block both ways (the block's keys as each slot's extra keys)."""

    layout: Layout
    anchors: int
    block: int

    @classmethod
    def of(cls, document_ids: torch.Tensor, anchors: torch.Tensor, block: int) -> BlockLayout:
        """anchors [R, n] row positions of the blocks."""
        return cls(Layout.before_positions(document_ids, anchors, block, extra=block), anchors.shape[1], block)

    def attend(self, q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, context_kv) -> torch.Tensor:
        """q [R, H, Q, d], the blocks' k/v [R, Hkv, Q, d], the context's (k, v) [R, Hkv, C, d] -> [R, Q, H, d]."""
        r, heads, q_len, d = q.shape
        kv_heads = k_blk.shape[1]
        scale = d ** -0.5
        shape = (r, self.anchors, self.block, kv_heads)
        qg = q.transpose(1, 2).reshape(*shape, heads // kv_heads, d)  # [R, n, B, Hkv, g, d]
        kb = k_blk.transpose(1, 2).reshape(*shape, d)  # [R, n, B, Hkv, d]
        vb = v_blk.transpose(1, 2).reshape(*shape, -1)
        scores = torch.einsum("rnqhgd,rnkhd->rnqhgk", qg.float(), kb.float()) * scale  # each slot over its block
        flat = (r * q_len, heads)
        main, weights = ranged_attention(q.transpose(1, 2).reshape(*flat, d), context_kv[0], context_kv[1],
                                         self.layout, scale, scores.reshape(*flat, self.block))
        own = torch.einsum("rnqhgk,rnkhd->rnqhgd", weights.view(*shape, heads // kv_heads, self.block), vb)
        return (main + own.reshape(*flat, -1)).view(r, q_len, heads, -1)


class DFlashLayer(nn.Module):
    def __init__(self, config) -> None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, rope, context_kv, mask):
        x = x + self.self_attn(self.input_layernorm(x), rope, context_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def qwen3_config(target_dir: str, hidden_size: int, vocab_size: int, config: DFlashConfig):
    """The draft layers' Qwen3Config, sized like the target's layers (heads, head_dim, eps, RoPE)."""
    from transformers import Qwen3Config

    llama = llama_layer_config(target_dir, hidden_size, vocab_size, num_layers=config.num_layers,
                               intermediate_size=config.intermediate_size).to_dict()
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "rms_norm_eps", "max_position_embeddings", "vocab_size", "num_hidden_layers", "hidden_act",
            "attention_bias", "tie_word_embeddings", "eos_token_id", "pad_token_id", "bos_token_id", "rope_parameters")
    return Qwen3Config(**{k: llama[k] for k in keep if k in llama})


class DFlashDrafter(Drafter):
    """The DFlash block drafter (see the module docstring)."""

    kind = "dflash"
    features = FEATURES
    label_offset: ClassVar[int] = 0
    """Slot j of a block anchored at a predicts x_{a+j+label_offset}: 0 for DFlash (slot 0 is the anchor, known;
    speculators' sample_from_anchor=false), 1 for DSpark (slot 0 drafts x_{a+1}: sample_from_anchor=true)."""

    def __init__(self, config: DFlashConfig, layer_config, aux_layer_ids, target: TargetHead,
                 num_speculative_tokens: int | None = None, verifier: str = "",
                 verifier_architectures=()) -> None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

        super().__init__()
        self.config = config
        self.layer_config = layer_config
        self.aux_layer_ids = tuple(int(i) for i in aux_layer_ids)
        h = layer_config.hidden_size
        self.target_hidden_size = h
        self.num_speculative_tokens = int(num_speculative_tokens or config.block_size - 1)
        self.verifier, self.verifier_architectures = verifier, list(verifier_architectures)
        self.mask_token_id = resolve_mask_token_id(config.mask_token_id, layer_config)
        self.fc = nn.Linear(len(self.aux_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=layer_config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(layer_config) for _ in range(config.num_layers)])
        self.norm = Qwen3RMSNorm(h, eps=layer_config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(layer_config)
        # the target's embeddings and lm_head, frozen, shared (not copied), never written (speculators reloads them)
        self.embed_tokens = nn.Embedding.from_pretrained(target.embed_tokens.detach(), freeze=True)
        self.register_buffer("target_lm_head", target.lm_head.detach(), persistent=False)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # -- construction -------------------------------------------------------------------------------------------
    @classmethod
    def for_run(cls, run_spec, target: TargetHead, num_speculative_tokens: int, **family_options: Any
                ) -> DFlashDrafter:
        config = cls.config_class(**family_options)
        kind = cls.display_name()
        n = int(run_spec.num_hidden_layers)
        aux = aux_layers_for_run(run_spec, config.aux_layer_ids, kind=kind, uses="builds its context from aux layers",
                                 suggest=(1, n // 2, n - 1, n))
        most = config.block_size - 1 + cls.label_offset  # DSpark's slot 0 drafts too
        if num_speculative_tokens > most:
            raise ValueError(f"--num-speculative-tokens {num_speculative_tokens}: a {kind} block of "
                             f"{config.block_size} drafts at most {most}; raise block_size (--family-options)")
        target_folder(target, kind)
        layer_config = qwen3_config(target.model_dir, target.hidden_size, target.vocab_size, config)
        from transformers import AutoConfig

        archs = getattr(AutoConfig.from_pretrained(target.model_dir), "architectures", None) or []
        return cls(config, layer_config, aux, target, num_speculative_tokens, verifier=os.path.abspath(target.model_dir),
                   verifier_architectures=archs).to(torch.float32)  # trained in float32, the target's parts too

    @classmethod
    def default_num_speculative_tokens(cls, family_options: dict[str, Any]) -> int:
        """A block's drafts: block_size - 1 (DSpark: block_size, its slot 0 drafting too)."""
        return cls.config_class(**family_options).block_size - 1 + cls.label_offset

    @classmethod
    def display_name(cls) -> str:
        return {"dflash": "DFlash", "dspark": "DSpark"}.get(cls.checkpoint_type, cls.checkpoint_type)

    # -- the model ----------------------------------------------------------------------------------------------
    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., A, H] -> [..., H] the context entry: hidden_norm(fc(aux))."""
        return self.hidden_norm(self.fc(aux.flatten(-2).to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the context's keys and values: context [R, C, H] at positions [R, C]."""
        cos, sin = self.rotary_emb(context, positions)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def blocks(self, tokens: torch.Tensor, positions: torch.Tensor, kv, mask) -> torch.Tensor:
        """tokens / positions [R, Q] the block slots, kv from context_kv, mask a BlockLayout or [R, 1, Q, C + Q]
        bool -> [R, Q, H]."""
        x = self.embed_tokens(tokens).to(self.fc.weight.dtype)
        rope = self.rotary_emb(x, positions)
        for layer, layer_kv in zip(self.layers, kv):
            x = layer(x, rope, layer_kv, mask)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] the target's lm_head over the normed output."""
        x = self.norm(h)
        return x @ self.target_lm_head.to(x.dtype).T

    # -- training -----------------------------------------------------------------------------------------------
    def training_step(self, batch: DrafterBatch, target: TargetHead) -> StepResult:
        b_size, gamma = self.block_size, self.config.gamma
        r, s = batch.input_ids.shape
        dev = batch.input_ids.device
        # anchors: a whose x_{a+1} is trained and in a's document; up to max_anchors per row, drawn at random
        ok = self._anchor_ok(batch)
        n = min(self.config.max_anchors, max(1, int(ok.sum(-1).max())))
        score = torch.rand((r, s), device=dev).masked_fill(~ok, 2.0)
        anchors = score.topk(n, dim=-1, largest=False).indices.sort(-1).values  # [R, n]
        out, labels, trained = self.anchored_blocks(batch, anchors, ok)
        rows, blk, slot = trained.nonzero(as_tuple=True)
        at = labels[rows, blk, slot] - 1  # the teacher of slot j: the target's distribution of x_{a+j}, at a+j-1
        steps = b_size - 1
        correct = torch.zeros(steps, dtype=torch.long)
        counted = torch.zeros(steps, dtype=torch.long)
        if not rows.numel():
            return StepResult(out.sum() * 0.0, correct, counted)
        chunk = self.memory.ce_chunk_tokens
        with torch.no_grad():
            if batch.target_topk is not None:
                ids, logprobs = (t[rows, at] for t in batch.target_topk)
                greedy = ids[:, 0]
                teacher = functools.partial(_topk_teacher, ids, logprobs, self.layer_config.vocab_size)
            else:
                last = batch.layer(max(batch.layer_ids))[rows, at]  # [M, H] the target's last layer there
                teacher = softmax_of(target.logits, last)
                greedy = chunked_argmax(target.logits, last, chunk)
        weight = torch.exp(-(slot.float() - 1) / gamma)
        # [M, V] logits (in chunks with --ce-chunk-tokens), weighted cross-entropy against the target's distribution
        total, best = cross_entropy(out[rows, blk, slot], self.logits, teacher, chunk=chunk, weight=weight)
        loss = total / weight.sum()
        with torch.no_grad():
            hit = best == greedy
            for j in range(1, b_size):
                sel = slot == j
                counted[j - 1] = int(sel.sum())
                correct[j - 1] = int((hit & sel).sum())
        return StepResult(loss, correct, counted)

    def recomputable(self) -> list[nn.Module]:
        """--gradient-checkpointing: whole draft layers (they read the context's keys, write nothing)."""
        return list(self.layers)

    @staticmethod
    def _anchor_ok(batch: DrafterBatch) -> torch.Tensor:
        """[R, S] bool: positions a whose x_{a+1} is trained and in a's document (the anchors that teach)."""
        return batch.same_document(1) & batch.shifted(batch.loss_mask, 1, False)

    def anchored_blocks(self, batch: DrafterBatch, anchors: torch.Tensor, ok: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The training forward of the blocks at `anchors` [R, n] (row positions): each block [x_a, mask, ...] at
        positions a..a+B-1 sees its document's context before a and itself both ways. Returns the slot outputs
        [R, n, B, H], the row position of the token each slot predicts [R, n, B] (a + j + label_offset, clamped to
        the row), and which slots train [R, n, B] (that token in the anchor's document and loss-masked, slot 0 only
        where it predicts, at an anchor that teaches; `ok`: _anchor_ok(batch) when the caller has it)."""
        b_size = self.block_size
        r, s = batch.input_ids.shape
        n = anchors.shape[1]
        dev = batch.input_ids.device
        aux = torch.stack([batch.layer(i) for i in self.aux_layer_ids], dim=2)  # [R, S, A, H]
        anchor_ok = (self._anchor_ok(batch) if ok is None else ok).gather(1, anchors)  # [R, n]
        offsets = torch.arange(b_size, device=dev)
        unclamped = anchors[:, :, None] + offsets + self.label_offset  # [R, n, B] the predicted token's position
        labels = unclamped.clamp(max=s - 1)
        doc = batch.document_ids
        a_doc = doc.gather(1, anchors)  # [R, n]
        in_doc = (unclamped < s) & (doc.gather(1, labels.flatten(1)).view(r, n, b_size) == a_doc[:, :, None])
        trained = in_doc & batch.loss_mask.gather(1, labels.flatten(1)).view(r, n, b_size) & anchor_ok[:, :, None]
        if not self.label_offset:
            trained[:, :, 0] = False  # slot 0 is the anchor, known
        tokens = torch.full((r, n, b_size), self.mask_token_id, dtype=torch.long, device=dev)
        tokens[:, :, 0] = batch.input_ids.gather(1, anchors)
        positions = batch.position_ids.gather(1, anchors)[:, :, None] + offsets  # [R, n, B]
        # attention: slot of block i sees context j < anchor_i of its document, and its own block
        layout = BlockLayout.of(doc, anchors, b_size)
        context = self.context(aux)
        kv = self.context_kv(context, batch.position_ids)
        out = self.blocks(tokens.view(r, n * b_size), positions.view(r, n * b_size), kv, layout)  # [R, Q, H]
        return out.view(r, n, b_size, -1), labels, trained

    # -- checkpoint (speculators' dflash layout) ------------------------------------------------------------------
    def checkpoint_config(self) -> dict[str, Any]:
        layer = self.layer_config.to_dict()
        layer.pop("_attn_implementation_autoset", None)
        return {
            "architectures": [ARCHITECTURE], "speculators_model_type": SPECULATORS_MODEL_TYPE,
            "transformer_layer_config": layer, "draft_vocab_size": int(self.layer_config.vocab_size),
            "block_size": self.block_size, "aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "mask_token_id": self.mask_token_id, "sliding_window_non_causal": True, "sample_from_anchor": False,
            "target_hidden_size": self.target_hidden_size,
            "torch_dtype": str(self.fc.weight.dtype).removeprefix("torch."),
            "speculators_config": {
                "algorithm": SPECULATORS_MODEL_TYPE, "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.num_speculative_tokens}],
                "verifier": {"name_or_path": self.verifier, "architectures": self.verifier_architectures},
            },
            "hsx_dflash": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.config).items()},
        }

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

    # what a subclass (DSpark) changes of the checkpoint it reads
    checkpoint_type: ClassVar[str] = SPECULATORS_MODEL_TYPE
    config_class: ClassVar[type] = DFlashConfig
    options_key: ClassVar[str] = "hsx_dflash"

    @classmethod
    def check_checkpoint(cls, model_dir: str, doc: dict[str, Any]) -> None:
        """ValueError for a config.json of this layout that hsx's family does not read."""
        check_block_attention(model_dir, doc)
        if doc.get("sample_from_anchor"):
            raise ValueError(f"{model_dir}: sample_from_anchor=true (DSpark-style slots) is not supported by hsx's "
                             "DFlash; slot j must predict x_{a+j} (method dspark reads such checkpoints)")

    @classmethod
    def checkpoint_options(cls, doc: dict[str, Any]) -> dict[str, Any]:
        """Config options config.json states in speculators' own keys (beyond hsx's own record)."""
        return {}

    @classmethod
    def from_pretrained(cls, model_dir: str, *, target_dir: str | None = None, target: TargetHead | None = None,
                        device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> DFlashDrafter:
        """Reload a checkpoint; embeddings and lm_head are `target`'s (a loaded target's, shared: the head is built
        in its dtype and on its device unless `dtype` / `device` say otherwise), else read from `target_dir` (default:
        the verifier it names)."""
        from safetensors.torch import load_file
        from transformers import Qwen3Config

        if target is not None:  # a loaded target's tensors stay shared: its dtype and device unless told otherwise
            dtype, device = dtype or target.lm_head.dtype, device or target.lm_head.device
        kind = cls.display_name()
        doc = read_checkpoint_json(model_dir, f"a {kind}")
        if doc.get("speculators_model_type") != cls.checkpoint_type:
            raise ValueError(f"{model_dir}: config.json has speculators_model_type "
                             f"{doc.get('speculators_model_type')!r}, not {cls.checkpoint_type!r}")
        cls.check_checkpoint(model_dir, doc)
        layer_config = Qwen3Config.from_dict(doc["transformer_layer_config"])
        if int(doc.get("draft_vocab_size") or layer_config.vocab_size) != layer_config.vocab_size:
            raise ValueError(f"{model_dir}: a draft vocabulary of {doc['draft_vocab_size']} (of "
                             f"{layer_config.vocab_size}) — hsx's {kind} drafts in the whole vocabulary")
        spec = doc.get("speculators_config") or {}
        verifier = spec.get("verifier") or {}
        target_dir = target_dir or verifier.get("name_or_path") or ""
        target = verifier_head(model_dir, target_dir, layer_config.hidden_size, layer_config.vocab_size, kind,
                               target)
        known = {f.name for f in fields(cls.config_class)}
        options = {k: v for k, v in (doc.get(cls.options_key) or {}).items() if k in known}
        options.update(block_size=int(doc["block_size"]), num_layers=int(layer_config.num_hidden_layers),
                       mask_token_id=doc.get("mask_token_id"), **cls.checkpoint_options(doc))
        config = cls.config_class(**options)
        methods = spec.get("proposal_methods") or [{}]
        model = cls(config, layer_config, doc["aux_hidden_state_layer_ids"], target,
                    int(methods[0].get("speculative_tokens") or cls.default_num_speculative_tokens(asdict(config))),
                    verifier=target_dir, verifier_architectures=verifier.get("architectures", []))
        model.to(dtype or getattr(torch, doc.get("torch_dtype") or "float32"))
        # the target's embeddings are the head's (shared with a loaded target): a checkpoint's own never overwrite
        # them; nor its lm_head, d2t or t2d (hsx drafts in the whole vocabulary)
        state = {k: v for k, v in load_file(os.path.join(model_dir, WEIGHTS_NAME)).items()
                 if not k.startswith(("embed_tokens.", "lm_head.", "t2d", "d2t"))}
        load_weights(model, model_dir, state, not_written=("embed_tokens.",), kind=kind)
        return model.to(device or "cpu").eval()


def check_block_attention(model_dir: str, doc: dict[str, Any]) -> None:
    """ValueError for a block-drafter checkpoint whose layers attend within the block causally or through a window
    (speculators' default: every layer sliding, sliding_window_non_causal false): hsx's blocks attend both ways over
    the whole context, so such a head would decode with another mask than it was trained with."""
    layer = doc.get("transformer_layer_config") or {}
    sliding = "sliding_attention" in (layer.get("layer_types") or []) or bool(layer.get("use_sliding_window"))
    if sliding and not doc.get("sliding_window_non_causal"):
        raise ValueError(f"{model_dir}: its draft layers use sliding windows with a causal block "
                         "(sliding_window_non_causal false); hsx's block drafters attend within the block both ways "
                         "over the whole context: train it with full-attention layers, or decode it in vLLM")


def _topk_teacher(ids: torch.Tensor, logprobs: torch.Tensor, vocab: int, index: torch.Tensor) -> torch.Tensor:
    """[n, V] a top-k run's distribution at rows `index`."""
    return topk_distribution(ids[index], logprobs[index], torch.arange(vocab, device=ids.device), vocab)


FAMILY = Family(name="dflash", description="a DFlash (speculators dflash) block-drafter checkpoint",
                drafter="drafters.dflash:DFlashDrafter", proposer_class="drafters.dflash_proposer:DFlashProposer",
                config_matches=lambda config: config.get("speculators_model_type") == SPECULATORS_MODEL_TYPE,
                config_k=speculators_num_speculative_tokens, parallel=True, features=FEATURES)
"""DFlash in the registry (pyproject.toml's hsx.drafters entry point `dflash`)."""
