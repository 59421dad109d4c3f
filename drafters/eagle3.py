"""EAGLE-3: a one-layer draft decoder over the target's fused aux-layer states, trained with test-time training.

    Eagle3Config                 the family's options (draft depth, draft vocabulary, unroll steps, ...)
    Eagle3Drafter                the model (Drafter kind "eagle3"):
        embed_tokens  [V, H]          the target's input embeddings, frozen
        fc            [H, A*H]        fuses the A aux layers' states of x_t (the run's layers but N), no bias
        layers[0]     Eagle3FirstLayer: attention over [norm(embed x_{t+1}) ; hidden_norm(fused)] (2H wide, RoPE),
                                      residual on the fused state, MLP; transformers' Llama modules
        layers[1:]    plain LlamaDecoderLayer (num_layers > 1)
        norm, lm_head [D, H]          final RMSNorm and the draft-vocabulary head; d2t [D] / t2d [V] map it to the
                                      target's ids (drafters/vocab.py)
    Eagle3Drafter.training_step  the multi-step unroll (below), soft-label cross-entropy against the target
    save_pretrained / from_pretrained   the speculators checkpoint vLLM's eagle3 method serves
    FEATURES, FAMILY             what it reads from a run (aux layers; N or a top-k target), EAGLE-3 in the drafter
                                 registry; its proposer is drafters/eagle3_proposer.py

A top-k target run (`--target top_k:K`) trains the same way: the teacher is the stored top-K distribution
(renormalised over the top-K tokens in the draft vocabulary) instead of the target's head on layer N.

Test-time training (EAGLE-3 paper, sec. 3): chain t starts from the target's states. Step 0 reads
(fc(aux of x_t), embed x_{t+1}) at position t and predicts x_{t+2}; step s >= 1 reads the drafter's own previous
output of the same chain in place of the fused state, with embed x_{t+1+s}, at position t+s, and predicts
x_{t+2+s}. Its attention sees what decoding would have in the cache: step 0's keys of positions <= t of the same
document, and the chain's own keys of steps 1..s (a diagonal per earlier step). Targets: the target's distribution
at position t+1+s (TargetHead on the stored last layer N), restricted to the draft vocabulary and renormalised;
only chains whose predicted token has loss_mask 1 and lies in chain t's document count.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drafters.base import (
    EMBED_KEYS,
    WEIGHTS_NAME,
    Drafter,
    DrafterBatch,
    StepResult,
    TargetHead,
    load_weights,
    read_checkpoint_json,
    read_target_tensor,
    speculators_num_speculative_tokens,
    target_folder,
    topk_distribution,
)
from drafters.features import Features, aux_layers_for_run
from drafters.llama_layers import cache_kwarg, llama_layer_config, with_draft_attention
from drafters.memory import chunked_argmax, cross_entropy, rows_of
from drafters.registry import Family
from drafters.ttt import UnrollStep, needed_chains, unroll_chains
from drafters.vocab import DraftVocab, build_draft_vocab

logger = logging.getLogger(__name__)

ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_MODEL_TYPE = "eagle3"

FEATURES = Features(aux_layers=3, top_k=True)
"""EAGLE-3 fuses aux layers (EAGLE-3's three: 2, N//2, N-3, unless aux_layer_ids says) and reads layer N only as its
teacher's distribution, which a top-k target can stand in for."""


@dataclass(frozen=True)
class Eagle3Config:
    """EAGLE-3's options (`hsx train-drafter --kind eagle3` passes the matching flags)."""

    num_layers: int = 1
    """Draft decoder layers (the paper and speculators use 1); the first takes the 2H-wide input."""
    draft_vocab_size: int = 32000
    """Tokens the draft head predicts: the run's most frequent trained tokens (capped at the target's vocabulary;
    as large as it = the whole vocabulary, no d2t/t2d)."""
    ttt_steps: int = 3
    """Test-time-training unroll: each chain is trained on this many consecutive drafts of its own."""
    step_loss_decay: float = 1.0
    """Weight of step s's loss is decay**s (1.0: all steps alike)."""
    norm_before_residual: bool = False
    """Residual of the first layer from the normed fused state (True) or the raw one (False), as speculators."""
    aux_layer_ids: tuple[int, ...] | None = None
    """vLLM ids of the fused layers; None = every stored layer of the run but N, in stored order."""
    intermediate_size: int | None = None
    """MLP width of the draft layer; None = the target's."""
    init_lm_head_from_target: bool = True
    """Start lm_head as the target's lm_head rows of the draft vocabulary."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1 (1 = no unroll), got {self.ttt_steps}")
        if not self.step_loss_decay > 0:
            raise ValueError(f"step_loss_decay must be > 0, got {self.step_loss_decay}")
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
            if not self.aux_layer_ids:
                raise ValueError("aux_layer_ids is empty; give the fused layers (e.g. 2,16,29) or None for the "
                                 "run's layers but N")


class Eagle3FirstLayer(nn.Module):
    """The first draft layer: transformers' LlamaAttention / LlamaMLP / LlamaRMSNorm, q/k/v widened to 2H.

    Names as speculators': input_layernorm (embeddings), hidden_norm (fused state), self_attn, post_attention_layernorm,
    mlp."""

    def __init__(self, layer_config, norm_before_residual: bool) -> None:
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        super().__init__()
        h, eps = layer_config.hidden_size, layer_config.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = LlamaAttention(layer_config, layer_idx=0)
        attn = self.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # the input is [embedding ; fused state]: 2H wide
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(layer_config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, attention_mask, cache):
        # embeds, hidden [R, S, H] -> [R, S, H]
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [R, S, 2H]
        x, _ = self.self_attn(hidden_states=x, position_embeddings=position_embeddings, attention_mask=attention_mask,
                              **cache_kwarg(cache))
        x = residual + x
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(Drafter):
    """The EAGLE-3 draft model (see the module docstring for its parts and training)."""

    kind = "eagle3"
    reads_image_embeddings = True
    features = FEATURES
    speculators_model_type: str = SPECULATORS_MODEL_TYPE
    """config.json's speculators_model_type (and the speculators_config algorithm) of this class's checkpoints."""
    architecture: str = ARCHITECTURE

    def __init__(self, config: Eagle3Config, layer_config, aux_layer_ids: Sequence[int], target_hidden_size: int,
                 num_speculative_tokens: int = 3, verifier: str = "", verifier_architectures: Sequence[str] = ()
                 ) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        self.config = config
        self.layer_config = with_draft_attention(layer_config)
        self.aux_layer_ids = tuple(int(i) for i in aux_layer_ids)
        self.target_hidden_size = int(target_hidden_size)
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.verifier, self.verifier_architectures = verifier, list(verifier_architectures)
        h, vocab = layer_config.hidden_size, layer_config.vocab_size
        draft_vocab = min(config.draft_vocab_size, vocab)
        self.embed_tokens = nn.Embedding(vocab, h)  # [V, H] the target's, frozen
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(self.aux_layer_ids) * self.target_hidden_size, h, bias=False)  # [H, A*H]
        self.layers = nn.ModuleList([Eagle3FirstLayer(layer_config, config.norm_before_residual)]
                                    + [LlamaDecoderLayer(layer_config, i) for i in range(1, config.num_layers)])
        self.norm = LlamaRMSNorm(h, eps=layer_config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)  # [D, H]
        self.rotary_emb = LlamaRotaryEmbedding(layer_config)  # no weights (inv_freq is not persistent)
        vocab_map = DraftVocab(torch.arange(draft_vocab, dtype=torch.int64), vocab)  # placeholder until prepare()
        self.register_buffer("d2t", vocab_map.d2t)  # [D] int64
        self.register_buffer("t2d", vocab_map.t2d)  # [V] bool
        self._target_lm_head: torch.Tensor | None = None  # for prepare(): lm_head starts as the target's rows

    # -- construction -------------------------------------------------------------------------------------------
    @classmethod
    def for_run(cls, run_spec, target: TargetHead, num_speculative_tokens: int, **family_options: Any
                ) -> Eagle3Drafter:
        config = cls.config_class(**family_options)
        n = int(run_spec.num_hidden_layers)
        aux = aux_layers_for_run(run_spec, config.aux_layer_ids, kind="EAGLE-3", uses="fuses the states of aux layers",
                                 suggest=(2, n // 2, n - 3, n))
        target_folder(target, "EAGLE-3")
        layer_config = llama_layer_config(target.model_dir, target.hidden_size, target.vocab_size,
                                          num_layers=config.num_layers, intermediate_size=config.intermediate_size)
        from transformers import AutoConfig

        archs = getattr(AutoConfig.from_pretrained(target.model_dir), "architectures", None) or []
        model = cls(config, layer_config, aux, target.hidden_size, num_speculative_tokens,
                    verifier=os.path.abspath(target.model_dir), verifier_architectures=archs)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(target.embed_tokens.to(torch.float32))
        if config.init_lm_head_from_target:
            model._target_lm_head = target.lm_head
            model._init_lm_head()
        return model

    def prepare(self, dataset: Any) -> None:
        """The draft vocabulary from the run's loss-masked tokens: one pass over the dataset before the first step,
        reading only token ids and loss masks where the dataset can (HiddenStatesDataset.token_items), whole items
        otherwise."""
        if self.lm_head.out_features >= self.layer_config.vocab_size:
            return  # the whole vocabulary: nothing to choose
        items = dataset.token_items() if hasattr(dataset, "token_items") else dataset
        vocab = build_draft_vocab(items, self.layer_config.vocab_size, self.lm_head.out_features)
        self.set_vocab(vocab)
        self._init_lm_head()

    def set_vocab(self, vocab: DraftVocab) -> None:
        if vocab.size != self.lm_head.out_features or vocab.target_vocab_size != self.layer_config.vocab_size:
            raise ValueError(f"a draft vocabulary of {vocab.size} over {vocab.target_vocab_size} tokens does not fit "
                             f"this head ({self.lm_head.out_features} over {self.layer_config.vocab_size})")
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)

    def _init_lm_head(self) -> None:
        if self._target_lm_head is None:
            return
        with torch.no_grad():
            rows = self._target_lm_head[self.draft_ids.cpu()]  # [D, H]
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight.device, self.lm_head.weight.dtype))

    @property
    def draft_ids(self) -> torch.Tensor:
        """[D] int64 the target id of each draft-vocabulary entry."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def _draft_index(self) -> torch.Tensor:
        """[V] int64 each target id's position in the draft vocabulary, -1 where it has none."""
        index = torch.full((self.t2d.numel(),), -1, dtype=torch.long, device=self.d2t.device)
        index[self.draft_ids] = torch.arange(self.d2t.numel(), device=self.d2t.device)
        return index

    # -- the model ----------------------------------------------------------------------------------------------
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., A, H_target] (the aux layers of x_t, in aux_layer_ids order) -> [..., H]."""
        return self.fc(aux.flatten(-2))

    def decode(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
        """One pass of the draft layers: input_ids [R, S] (x_{t+1}), hidden [R, S, H] (fused or own) ->
        [R, S, H] the pre-norm output (fed back as the next step's hidden). Decoding: attention_mask [R, 1, S, K]
        bool over the cache's keys after this call's are appended (K), cache a transformers Cache; training: both are
        one drafters.attention.TTTAttention (the unroll's keys and their ranges)."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # [R, S, H]
        rope = self.rotary_emb(hidden, position_ids)  # cos, sin [R, S, head_dim]
        x = self.layers[0](embeds, hidden, rope, attention_mask, cache)
        for layer in self.layers[1:]:
            x = layer(x, attention_mask=attention_mask, position_ids=position_ids, **cache_kwarg(cache),
                      position_embeddings=rope)
        return x

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """[..., H] pre-norm output -> [..., D] draft-vocabulary logits."""
        return self.lm_head(self.norm(hidden_out))

    # -- training -----------------------------------------------------------------------------------------------
    def unroll(self, aux: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
               document_ids: torch.Tensor, steps: int, chains: list[torch.Tensor | None] | None = None
               ) -> list[torch.Tensor]:
        """The test-time-training unroll: aux [R, S, A, H] (aux states of x_t), input_ids / position_ids /
        document_ids [R, S] -> per step s, the pre-norm outputs [R, S, H] of chain t's draft s (`logits` of it
        predicts x_{t+2+s}); `chains` as unroll_steps' (None: every chain at every step)."""
        return [step.grid(input_ids.shape[0])
                for step in self.unroll_steps(aux, input_ids, position_ids, document_ids, chains or [None] * steps)]

    def unroll_steps(self, aux: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     document_ids: torch.Tensor, chains: list[torch.Tensor | None],
                     images: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[UnrollStep]:
        """The unroll over the chains each step needs (drafters/ttt.unroll_chains; chains[s] flat positions, None:
        all): step 0 reads the fused aux states, step s >= 1 the chain's own previous output. `images` (mask [R, S],
        embeddings [R, S, H], DrafterBatch.input_overrides): the target's merged embeddings at image tokens."""
        extra = {} if images is None else {"images": (self.embed_tokens, *images)}
        return unroll_chains(self.decode, self.fuse(aux.to(self.fc.weight.dtype)), input_ids, position_ids,
                             document_ids, chains, self.step_inputs, **extra)

    def step_inputs(self, step: int, ids: torch.Tensor, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The token ids and hidden states step `step` reads: EAGLE-3's, x_{t+1+s} and the chain's previous output
        (step 0: the fused aux states)."""
        return ids, previous

    def trained_chains(self, valid: torch.Tensor, step: int) -> torch.Tensor:
        """valid [R, S] bool: the chains whose draft `step` the loss counts (EAGLE-3: all of them)."""
        return valid

    def recomputable(self) -> list[nn.Module]:
        """--gradient-checkpointing: the draft layers' MLPs (their attention writes the unroll's keys)."""
        return [layer.mlp for layer in self.layers]

    def training_step(self, batch: DrafterBatch, target: TargetHead) -> StepResult:
        aux = torch.stack([batch.layer(i) for i in self.aux_layer_ids], dim=2)  # [R, S, A, H]
        chunk = self.memory.ce_chunk_tokens
        with torch.no_grad():  # the target's prediction at u of x_{u+1}, only where x_{u+1} is trained
            need = batch.same_document(1) & batch.shifted(batch.loss_mask, 1, False)  # [R, S]
            if batch.target_topk is None and max(batch.layer_ids) in self.aux_layer_ids:
                raise ValueError(f"the batch holds layers {list(batch.layer_ids)} and no top-k target: nothing "
                                 "stands for the last layer N the teacher reads")
            rows, cols = need.nonzero(as_tuple=True)
            greedy = torch.zeros(need.shape, dtype=torch.long, device=need.device)  # [R, S] the target's token
            if batch.target_topk is not None:  # a top-k target run: the stored top-K tokens, best first
                greedy[need] = batch.target_topk[0][rows, cols, 0]
            else:
                greedy[need] = chunked_argmax(target.logits, batch.layer(max(batch.layer_ids))[need], chunk)
            table = None  # [R, S, D] the target's distributions, unless --ce-chunk-tokens computes them per chunk
            if not chunk:
                table = torch.zeros((*need.shape, self.lm_head.out_features), device=need.device)
                table[need] = self._target_distribution(batch, target, rows, cols)
        steps = self.config.ttt_steps
        # chains t whose draft s (x_{t+2+s}) is trained and in t's document: only those reach the lm_head, and a
        # step runs only the chains it or a later step trains
        trained = [self.trained_chains(batch.same_document(2 + s) & batch.shifted(batch.loss_mask, 2 + s, False), s)
                   for s in range(steps)]
        outputs = self.unroll_steps(aux, batch.input_ids, batch.position_ids, batch.document_ids,
                                    needed_chains(trained), batch.input_overrides())
        terms: list[tuple[int, torch.Tensor, int]] = []  # (step, mean cross-entropy, chains) per trained step
        correct = torch.zeros(steps, dtype=torch.long)
        counted = torch.zeros(steps, dtype=torch.long)
        for s, step in enumerate(outputs):
            rows, cols = trained[s].nonzero(as_tuple=True)  # [N]
            counted[s] = rows.numel()
            if not rows.numel():
                continue
            # against the target's distribution of x_{t+2+s}; the [N, D] logits in chunks with --ce-chunk-tokens
            teacher = rows_of(table, rows, cols + 1 + s) if table is not None else \
                functools.partial(self._teacher_at, batch, target, rows, cols + 1 + s)
            total, best = cross_entropy(step.take(rows, cols), self.logits, teacher, chunk=chunk)
            terms.append((s, total / rows.numel(), int(rows.numel())))
            with torch.no_grad():
                guess = self.draft_ids[best]  # [N] target ids
                correct[s] = int((guess == greedy[rows, cols + 1 + s]).sum())
        # nothing trained in the batch: a zero that still reaches the draft layers (the trainer's backward, DDP's)
        loss = self.combine_step_losses(terms) if terms else outputs[0].hidden.sum() * 0.0
        return StepResult(loss, correct, counted)

    def _target_distribution(self, batch: DrafterBatch, target: TargetHead, rows: torch.Tensor, cols: torch.Tensor
                             ) -> torch.Tensor:
        """[n, D] the target's distribution of the token after (rows, cols) on the draft vocabulary: its head on
        layer N, or the stored top-K renormalised."""
        if batch.target_topk is not None:
            ids, logprobs = (t[rows, cols] for t in batch.target_topk)  # [n, K]
            return topk_distribution(ids, logprobs, self._draft_index(), self.lm_head.out_features)
        logits = target.logits(batch.layer(max(batch.layer_ids))[rows, cols]).float()  # [n, V]
        return F.softmax(logits[:, self.draft_ids], dim=-1)

    def _teacher_at(self, batch: DrafterBatch, target: TargetHead, rows: torch.Tensor, cols: torch.Tensor,
                    index: torch.Tensor) -> torch.Tensor:
        """The teacher of chunk `index` of the positions (rows, cols) (--ce-chunk-tokens)."""
        return self._target_distribution(batch, target, rows[index], cols[index])

    def combine_step_losses(self, terms: list[tuple[int, torch.Tensor, int]]) -> torch.Tensor:
        """The loss from each trained step's (step, mean cross-entropy, chains): EAGLE-3 sums the steps' means,
        step s weighted step_loss_decay**s."""
        return sum(self.config.step_loss_decay ** s * ce for s, ce, _ in terms)

    # -- checkpoint (speculators layout) ------------------------------------------------------------------------
    def checkpoint_config(self) -> dict[str, Any]:
        """config.json of the speculators eagle3 format (vLLM's eagle3 method reads it)."""
        layer = self.layer_config.to_dict()
        layer.pop("_attn_implementation_autoset", None)
        # vLLM sizes fc from the layer config's num_aux_hidden_states (else eagle_config's ids, else 3): written,
        # a head fusing other than three aux layers loads there too
        layer["num_aux_hidden_states"] = len(self.aux_layer_ids)
        return {
            "architectures": [self.architecture],
            "speculators_model_type": self.speculators_model_type,
            "transformer_layer_config": layer,
            "draft_vocab_size": int(self.lm_head.out_features),
            "norm_before_residual": bool(self.config.norm_before_residual),
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "torch_dtype": str(self.fc.weight.dtype).removeprefix("torch."),
            "speculators_config": {
                "algorithm": self.speculators_model_type,
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy",
                                      "speculative_tokens": self.num_speculative_tokens}],
                "verifier": {"name_or_path": self.verifier, "architectures": self.verifier_architectures},
            },
            "hsx_eagle3": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.config).items()},
        }

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if bool(self.t2d.all()) and self.t2d.numel() == self.d2t.numel():
            state.pop("d2t"), state.pop("t2d")  # the whole vocabulary: speculators omits the maps
        return state

    config_class: type = Eagle3Config
    """The options dataclass (a subclass's own, with more fields)."""

    @classmethod
    def _options_from_checkpoint(cls, doc: dict[str, Any]) -> dict[str, Any]:
        """Options a subclass reads from its checkpoint's own config.json keys (none for EAGLE-3)."""
        return {}

    @classmethod
    def from_pretrained(cls, model_dir: str, *, embed_tokens: torch.Tensor | None = None,
                        device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Eagle3Drafter:
        """Reload a checkpoint; one without embeddings (speculators may leave them out) takes `embed_tokens` (a
        loaded target's input embeddings [V, H]: what the engine hands it), else its verifier folder's."""
        from safetensors.torch import load_file
        from transformers import LlamaConfig

        doc = read_checkpoint_json(model_dir, "an EAGLE-3")
        if doc.get("speculators_model_type") != cls.speculators_model_type:
            raise ValueError(f"{model_dir}: config.json has speculators_model_type "
                             f"{doc.get('speculators_model_type')!r}, not {cls.speculators_model_type!r}")
        layer_doc = dict(doc["transformer_layer_config"])
        layer_config = LlamaConfig.from_dict(layer_doc)
        known = {f.name for f in fields(cls.config_class)}
        options = {k: v for k, v in (doc.get("hsx_eagle3") or {}).items() if k in known}
        options.update(draft_vocab_size=int(doc["draft_vocab_size"]), num_layers=int(layer_config.num_hidden_layers),
                       norm_before_residual=bool(doc.get("norm_before_residual", False)),
                       init_lm_head_from_target=False)
        if options.get("aux_layer_ids") is not None:
            options["aux_layer_ids"] = tuple(options["aux_layer_ids"])
        spec = doc.get("speculators_config") or {}
        verifier = spec.get("verifier") or {}
        methods = spec.get("proposal_methods") or [{}]
        options.update(cls._options_from_checkpoint(doc))
        model = cls(cls.config_class(**options), layer_config,
                    doc["eagle_aux_hidden_state_layer_ids"],
                    int(doc.get("target_hidden_size") or layer_config.hidden_size),
                    int(methods[0].get("speculative_tokens", 3)), verifier=verifier.get("name_or_path", ""),
                    verifier_architectures=verifier.get("architectures", []))
        state = load_file(os.path.join(model_dir, WEIGHTS_NAME))
        if "embed_tokens.weight" not in state:  # speculators may leave it out: the verifier's embeddings
            state["embed_tokens.weight"] = _verifier_embeddings(model_dir, model.verifier, layer_config, embed_tokens)
        if "d2t" not in state:
            identity = DraftVocab.identity(layer_config.vocab_size)
            state["d2t"], state["t2d"] = identity.d2t, identity.t2d
        else:
            DraftVocab.from_maps(state["d2t"], state["t2d"])  # checked
        model_dtype = dtype or getattr(torch, doc.get("torch_dtype") or "float32")
        model.to(model_dtype)
        load_weights(model, model_dir, state, not_written=(), kind=cls.kind)
        return model.to(device).eval()


def _verifier_embeddings(model_dir: str, verifier: str, layer_config, given: torch.Tensor | None) -> torch.Tensor:
    """The target's input embeddings for a checkpoint that holds none: `given` (a loaded target's), else read from
    its verifier folder; ValueError when neither is there or their shape is not the head's [V, H]."""
    if given is None:
        if not verifier or not os.path.isdir(verifier):
            raise ValueError(f"{model_dir} holds no embed_tokens.weight and its verifier {verifier!r} is not a local "
                             "folder to take them from: decode it in hsx's engine (it hands the head the target's), "
                             "or add the embeddings to the checkpoint")
        given = read_target_tensor(verifier, EMBED_KEYS)
    want = (int(layer_config.vocab_size), int(layer_config.hidden_size))
    if tuple(given.shape) != want:
        raise ValueError(f"{model_dir} holds no embed_tokens.weight, and the target's embeddings are "
                         f"{tuple(given.shape)} while the head takes {want} (vocabulary, hidden size): add the head's "
                         "own embeddings to the checkpoint")
    return given


FAMILY = Family(name="eagle3", description="an EAGLE-3 (speculators) checkpoint",
                drafter="drafters.eagle3:Eagle3Drafter", proposer_class="drafters.eagle3_proposer:Eagle3Proposer",
                features=FEATURES,
                config_matches=lambda config: config.get("speculators_model_type") == "eagle3",
                config_k=speculators_num_speculative_tokens, options=("draft_vocab_size", "ttt_steps"))
"""EAGLE-3 in the registry (pyproject.toml's hsx.drafters entry point `eagle3`)."""
