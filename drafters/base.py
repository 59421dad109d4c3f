"""What every drafter family shares: the teacher, the batch a training step gets, the interface, checkpoint files.

    TargetHead.from_model_dir(dir)   the target's frozen final norm + lm_head (+ its family's logits transform):
                                     teacher logits from the stored last layer (pre-norm, vLLM id N), exactly what the
                                     target's own forward computes
    TargetHead.of_model(model)       the same parts of a loaded target (no copies): what a proposer reads out with
    topk_distribution(ids, logprobs, index, size)   a top-k target's distribution over a (draft) vocabulary
    DrafterBatch.from_packed(batch, layer_ids)   a PackCollator batch of a raw-layout HiddenStatesDataset
    StepResult                       one training step's loss and per-position top-1 agreement counts
    Drafter                          the interface every family implements (an nn.Module); by who calls it:
        trainer:   features / required_layer_ids (checked before training), for_run (construct),
                   default_num_speculative_tokens, prepare (optional, once), training_step (each batch),
                   save_pretrained (checkpoint_config + checkpoint_state, or its own)
        proposers, tests:  from_pretrained

    checkpoint files (every family):
        write_checkpoint(out_dir, config, tensors)   config.json + model.safetensors, each written whole
        read_checkpoint_json(dir, what) / read_config(dir, model_type) / read_tensors(dir)   reading them back
        load_weights(model, dir, state, not_written=, kind=) / load_state(module, state, dir)   checked loading
        speculators_num_speculative_tokens(config)   the k a speculators config.json proposes
        read_target_tensor(dir, names), LM_HEAD_KEYS, EMBED_KEYS   tensors of the target's own checkpoint
        verifier_head(...), runner_target(runner), target_folder(target, kind)   the target a head reads out with
        resolve_mask_token_id(mask_token_id, layer_config)   the token mask slots read (P-EAGLE, DFlash)

Alignment (the same in every family): position t of a row holds token x_t and the target's states *of* x_t
(hidden_states[:, t] = what the target computed after reading x_0..x_t); the target predicted x_{t+1} from them.
A drafter at position t predicts the tokens after x_{t+1}: draft position j (0-based) of the k it proposes is
x_{t+2+j} for Medusa / MLPSpeculator, whose input is the state of x_t plus (MLPSpeculator) the token x_{t+1};
EAGLE-3 reads the aux states of x_t with the embedding of x_{t+1} and predicts x_{t+2}, then unrolls on its own
outputs. Training targets are the target's distributions (soft labels: TargetHead on the stored last layer at the
position that predicts the token), or the corpus tokens themselves where a family trains on hard labels; a packed
row never pairs tokens across a document boundary (document_ids), and only positions whose predicted token has
loss_mask 1 count.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from connectors import storage
from connectors.format import TARGET_TOPK_IDS, TARGET_TOPK_LOGPROBS
from connectors.safetensors_file import safetensors_content
from drafters.features import Features
from drafters.memory import MemoryOptions, recompute_in_backward
from extractor.checkpoint_files import load_tensors, weight_map
from extractor.facts import text_config
from extractor.head import has_logits_transform, logits_transform
from extractor.norm import FinalNorm


def read_target_tensor(model_dir: str, names: tuple[str, ...]) -> torch.Tensor:
    """The first of `names` present in the target checkpoint at `model_dir` (e.g. lm_head or embedding weights)."""
    files = weight_map(model_dir, "drafters read the target's weights")
    key = next((k for k in names if k in files), None)
    if key is None:
        raise ValueError(f"the target checkpoint {model_dir!r} holds none of {list(names)}")
    return load_tensors(model_dir, [key], files=files)[key]


LM_HEAD_KEYS = ("lm_head.weight",)
EMBED_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight",
              "model.language_model.embed_tokens.weight")


@dataclass
class TargetHead:
    """The target's final norm and lm_head, frozen: logits(last_layer_pre_norm) = the target's own logits."""

    norm: FinalNorm
    lm_head: torch.Tensor  # [V, H]
    embed_tokens: torch.Tensor  # [V, H] the target's input embeddings (EAGLE-3 shares them)
    model_dir: str = ""
    """The target's local folder (from_model_dir sets it): families that size their layers from the target's
    config (EAGLE-3's decoder layer) read it from here."""
    num_hidden_layers: int | None = None
    """The target's decoder layers (N: its last layer's vLLM id), from its config."""
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    """What the family does to lm_head's output (extractor.head.logits_transform: Gemma's soft-cap, Granite's and
    Falcon-H1's scales, Cohere's logit scale); None: nothing. logits() applies it, so KL / TV losses learn the
    distribution the target serves."""

    @classmethod
    def from_model_dir(cls, model_dir: str) -> TargetHead:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir).get_text_config()
        embed = read_target_tensor(model_dir, EMBED_KEYS)
        if getattr(config, "tie_word_embeddings", False):
            head = embed
        else:
            head = read_target_tensor(model_dir, LM_HEAD_KEYS)
        return cls(FinalNorm.from_model_dir(model_dir), head, embed, model_dir, int(config.num_hidden_layers),
                   _transform_or_none(config))

    @classmethod
    def of_model(cls, model: nn.Module, model_dir: str = "") -> TargetHead:
        """The final norm, lm_head and input embeddings of a loaded transformers target, shared (not copied): an
        engine's proposer reads out with the very tensors the target computes with, on its device and dtype, and
        nothing is read from the target's folder again."""
        config = text_config(model.config)
        return cls(FinalNorm.of_model(model), model.get_output_embeddings().weight,
                   model.get_input_embeddings().weight, model_dir, int(config.num_hidden_layers),
                   _transform_or_none(config))

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.lm_head.shape[1])

    def to(self, device: torch.device | str, dtype: torch.dtype) -> TargetHead:
        norm = self.norm.to(dtype)
        norm.module.to(device)
        return TargetHead(norm, self.lm_head.to(device, dtype), self.embed_tokens.to(device, dtype), self.model_dir,
                          self.num_hidden_layers, self.transform)

    def post_norm(self, last_pre_norm: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., H]: the state lm_head reads (call .to() first to match device and dtype)."""
        return self.norm(last_pre_norm)

    def logits(self, last_pre_norm: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] the target's logits (no grad), its family's transform applied."""
        with torch.no_grad():
            x = self.post_norm(last_pre_norm)
            return self.transformed(x @ self.lm_head.to(x.device, x.dtype).T)

    def transformed(self, logits: torch.Tensor) -> torch.Tensor:
        """lm_head's output [..., V] -> the target's logits: its family's transform applied (identity for most)."""
        return self.transform(logits) if self.transform is not None else logits


def _transform_or_none(config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    return logits_transform(config) if has_logits_transform(config) else None


def topk_distribution(ids: torch.Tensor, logprobs: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """A top-k target's distribution over a vocabulary of `size` (a draft vocabulary, or the whole one): ids /
    logprobs [M, K] (target ids and their log-probabilities), index [V] the position of each target id in that
    vocabulary (-1: not in it) -> [M, size] probabilities, renormalised over the top-K tokens the vocabulary holds
    (all zeros in a row none of whose K tokens it holds: such a row teaches nothing)."""
    pos = index[ids]  # [M, K]
    probs = logprobs.float().exp() * (pos >= 0)  # [M, K]
    out = torch.zeros((ids.shape[0], size), dtype=torch.float32, device=ids.device)
    out.scatter_add_(1, pos.clamp(min=0), probs)
    return out / out.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)


@dataclass
class DrafterBatch:
    """One packed training batch (R rows of S tokens; several samples back to back per row)."""

    input_ids: torch.Tensor  # [R, S] int64
    hidden_states: torch.Tensor  # [R, S, L, H] the run's stored layers, in layer_ids order
    loss_mask: torch.Tensor  # [R, S] bool: x_t is a trained token
    position_ids: torch.Tensor  # [R, S] int64, restarting at 0 at each sample
    document_ids: torch.Tensor  # [R, S] int64, -1 on padding
    layer_ids: tuple[int, ...]  # vLLM ids of hidden_states' L axis
    target_topk: tuple[torch.Tensor, torch.Tensor] | None = None
    """A top-k target run's stand-in for layer N: (ids [R, S, K] int64, log-probabilities [R, S, K] float32), the
    target's K most likely tokens after x_t, best first; None when the run stores layer N itself."""
    image_mask: torch.Tensor | None = None
    """[R, S] bool: x_t is an image token (a multimodal run); None for text runs."""
    image_embeds: torch.Tensor | None = None
    """[R, S, H]: the target's merged input embedding of x_t where image_mask (the vision tower's output, what vLLM's
    proposer feeds the drafter there); None: the drafter embeds image tokens as any other (placeholder)."""

    def input_overrides(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mask [R, S], embeddings [R, S, H]) a drafter's token embeddings are replaced by (drafters.images), or
        None."""
        if self.image_mask is None or self.image_embeds is None:
            return None
        return self.image_mask, self.image_embeds

    @classmethod
    def from_packed(cls, batch: Mapping[str, Any], layer_ids: tuple[int, ...]) -> DrafterBatch:
        """From training.collate.PackCollator over a HiddenStatesDataset with layout "raw"."""
        if "hidden_states" not in batch:
            raise ValueError(f"the batch has no hidden_states (keys {sorted(batch)}); open the dataset with layout "
                             "'raw' for drafter training")
        topk = None
        if TARGET_TOPK_IDS in batch:
            topk = (batch[TARGET_TOPK_IDS].long(), batch[TARGET_TOPK_LOGPROBS])
        image = batch.get("image_mask")
        return cls(batch["input_ids"], batch["hidden_states"], batch["loss_mask"].bool(), batch["position_ids"],
                   batch["document_ids"], tuple(layer_ids), topk, None if image is None else image.bool(),
                   batch.get("image_embeds"))

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> DrafterBatch:
        hs = self.hidden_states.to(device, dtype) if dtype is not None else self.hidden_states.to(device)
        topk = None if self.target_topk is None else tuple(t.to(device) for t in self.target_topk)  # float32 kept
        image = None if self.image_mask is None else self.image_mask.to(device)
        embeds = None if self.image_embeds is None else self.image_embeds.to(device, dtype or self.image_embeds.dtype)
        return DrafterBatch(self.input_ids.to(device), hs, self.loss_mask.to(device), self.position_ids.to(device),
                            self.document_ids.to(device), self.layer_ids, topk, image, embeds)

    def layer(self, layer_id: int) -> torch.Tensor:
        """[R, S, H] the states of one stored layer id."""
        if layer_id not in self.layer_ids:
            raise ValueError(f"the run has layers {list(self.layer_ids)}, not {layer_id}")
        return self.hidden_states[:, :, self.layer_ids.index(layer_id)]

    def same_document(self, shift: int) -> torch.Tensor:
        """[R, S] bool: position t and t + shift exist and belong to the same sample (False past the row's end)."""
        r, s = self.document_ids.shape
        out = torch.zeros((r, s), dtype=torch.bool, device=self.document_ids.device)
        if shift < s:
            a, b = self.document_ids[:, :s - shift], self.document_ids[:, shift:]
            out[:, :s - shift] = (a == b) & (a >= 0)
        return out

    def shifted(self, x: torch.Tensor, shift: int, fill: int | float | bool = 0) -> torch.Tensor:
        """x [R, S, ...] moved left by `shift`: out[:, t] = x[:, t + shift] (fill past the end)."""
        out = torch.full_like(x, fill)
        if shift < x.shape[1]:
            out[:, :x.shape[1] - shift] = x[:, shift:]
        return out


@dataclass
class StepResult:
    loss: torch.Tensor  # scalar, differentiable
    correct: torch.Tensor  # [k] positions where draft j's top-1 equals the target's token (greedy)
    counted: torch.Tensor  # [k] positions trained at draft j

    def accuracy(self) -> list[float]:
        return [float(c) / max(1.0, float(n)) for c, n in zip(self.correct, self.counted)]

    def simulated_acceptance_length(self) -> float:
        """1 + a0 + a0·a1 + ... (SpecForge's proxy with vLLM's +1 bonus token): per-position teacher-forced
        accuracies as the chance each further draft survives."""
        total, chain = 1.0, 1.0
        for a in self.accuracy():
            chain *= a
            total += chain
        return total


class Drafter(nn.Module, ABC):
    """A trainable draft head. Subclasses set `kind` and implement the abstract methods; configs are dataclasses.

    Called by the trainer (train.py): for_run (construct) -> prepare (optional, once) -> training_step (each batch)
    -> save_pretrained (serving layout); by proposers and tests: from_pretrained.
    """

    kind: ClassVar[str]
    """The family's name (FAMILY.name): the speculative_config method that decodes with it."""
    reads_image_embeddings: ClassVar[bool] = False
    """Whether it embeds tokens itself and so reads the target's merged embeddings at image tokens (EAGLE-3, EAGLE,
    P-EAGLE: DrafterBatch.input_overrides); the others train on an image run without them."""
    features: ClassVar[Features] = Features()
    """What it reads from a run (drafters/features.py): the family module's FEATURES, also its Family.features."""

    @classmethod
    def required_layer_ids(cls, num_hidden_layers: int, config: Any = None) -> tuple[int, ...]:
        """vLLM layer ids the run must hold for this family (checked before training): features.required_layer_ids
        with the config's aux_layer_ids, when it has them."""
        return cls.features.required_layer_ids(num_hidden_layers, getattr(config, "aux_layer_ids", None))

    @classmethod
    @abstractmethod
    def for_run(cls, run_spec: Any, target: TargetHead, num_speculative_tokens: int, **family_options: Any) -> Drafter:
        """A fresh drafter for training on a run: the one constructor the trainer (train.py) calls for every family.

        run_spec: connectors.run.RunSpec of the run (its layer_ids, hidden size, the target's model name); target:
        the target's frozen head (vocab size, hidden size, embeddings to copy); num_speculative_tokens: k, the drafts
        per step at decoding (Medusa heads / MLPSpeculator stages; EAGLE-3 keeps it as its default k and unrolls
        its own number of test-time-training steps); family_options: the fields of the family's config dataclass
        (e.g. medusa_num_layers=1), unknown names raise TypeError. The trainer has already checked that the run
        holds required_layer_ids."""

    @classmethod
    def default_num_speculative_tokens(cls, family_options: dict[str, Any]) -> int:
        """k when `hsx train-drafter` is given no --num-speculative-tokens (3; a block drafter: its block - 1)."""
        return 3

    def prepare(self, dataset: Any) -> None:
        """Optional hook, called once by the trainer before the first step with the training dataset
        (a training.HiddenStatesDataset, raw layout): e.g. EAGLE-3 builds its draft vocabulary from the run's
        loss-masked tokens. Default: nothing. Not called when training resumes from a checkpoint."""

    @abstractmethod
    def training_step(self, batch: DrafterBatch, target: TargetHead) -> StepResult:
        """Loss over loss-masked positions of `batch`, and per-draft-position agreement with the target."""

    memory: MemoryOptions = MemoryOptions()
    """How training_step trades compute for memory (drafters/memory.py); the trainer sets it by use_memory."""

    def use_memory(self, options: MemoryOptions) -> None:
        """Train with `options` (--gradient-checkpointing, --ce-chunk-tokens, --autocast): what is learned is the
        same, the memory less."""
        self.memory = options
        for module in self.recomputable():
            recompute_in_backward(module, options.gradient_checkpointing)

    def recomputable(self) -> list[nn.Module]:
        """The modules --gradient-checkpointing recomputes in the backward (no side effects; default none)."""
        return []

    def save_pretrained(self, out_dir: str, *, verifier: str) -> None:
        """config.json + model.safetensors in the layout serving engines load (verifier = the target's path):
        checkpoint_config() and checkpoint_state(), which a family defines (or it overrides this)."""
        if verifier:
            self.verifier = verifier
        write_checkpoint(out_dir, self.checkpoint_config(), self.checkpoint_state())

    def checkpoint_config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} defines neither save_pretrained nor checkpoint_config")

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} defines neither save_pretrained nor checkpoint_state")

    @classmethod
    @abstractmethod
    def from_pretrained(cls, model_dir: str) -> Drafter:
        """Reload what save_pretrained wrote."""


# -- serving checkpoint files (every family) ------------------------------------------------------------------
WEIGHTS_NAME = "model.safetensors"


def write_checkpoint(out_dir: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """OUT/model.safetensors and OUT/config.json, each written whole and durably under a unique temporary name
    (connectors.storage.put_atomic), weights first: a reader never sees a config without its weights, and two
    writers never share a temporary file. The weights file is connectors.safetensors_file's deterministic
    safetensors bytes (each tensor written from its own memory, so tensors sharing storage need no copy); the
    config's keys are sorted, so the same drafter gives the same bytes."""
    import fsspec

    fs = fsspec.filesystem("file")
    os.makedirs(out_dir, exist_ok=True)
    storage.put_atomic(fs, os.path.join(out_dir, WEIGHTS_NAME), safetensors_content(tensors, {"format": "pt"}))
    storage.put_atomic(fs, os.path.join(out_dir, "config.json"),
                       (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())



def read_checkpoint_json(model_dir: str, what: str) -> dict[str, Any]:
    """A drafter checkpoint's config.json; ValueError naming the folder and the family (`what`) otherwise."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{model_dir}: no readable config.json ({e}); is this {what} checkpoint?") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{model_dir}: config.json is not a JSON object; is this {what} checkpoint?")
    return doc


def read_config(model_dir: str, model_type: str) -> dict:
    """A checkpoint's config.json whose model_type is `model_type` (Medusa's and MLPSpeculator's layouts);
    FileNotFoundError / ValueError naming the folder otherwise."""
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
    """Every tensor of a checkpoint's model.safetensors."""
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


def runner_target(runner) -> TargetHead:
    """The target an engine's runner holds, as a TargetHead sharing its tensors (TargetHead.of_model)."""
    return TargetHead.of_model(runner.model, runner.config.model)


def verifier_head(model_dir: str, target_dir: str | None, hidden_size: int, vocab_size: int, kind: str,
                  target: TargetHead | None = None) -> TargetHead:
    """The frozen head of the target a checkpoint reads out with (its lm_head, embeddings, final norm): `target` (a
    loaded target's, TargetHead.of_model), else read from `target_dir` (the verifier the checkpoint names, unless
    given); ValueError when that is no local folder or the sizes differ."""
    if target is None:
        if not target_dir or not os.path.isdir(target_dir):
            raise ValueError(f"{model_dir}: {kind} reads the target's own weights, but its target {target_dir!r} is "
                             "not a local folder; pass the target folder")
        target = TargetHead.from_model_dir(target_dir)
    if target.hidden_size != hidden_size or target.vocab_size != vocab_size:
        raise ValueError(f"{model_dir}: the {kind} head has hidden size {hidden_size} and vocabulary {vocab_size}, its "
                         f"target {target.model_dir or target_dir} has {target.hidden_size} and {target.vocab_size}: it was trained for "
                         "another model")
    return target


def load_weights(model: nn.Module, model_dir: str, state: Mapping[str, torch.Tensor], *, not_written: tuple[str, ...],
                 kind: str) -> None:
    """`state` (the checkpoint's tensors) into `model`; every parameter but those under the `not_written` prefixes
    (the target's own parts) must be there, and nothing else; ValueError naming what differs."""
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    missing = [k for k in missing if not k.startswith(not_written)]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not match a {kind} head of this config (missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)})")


def speculators_num_speculative_tokens(config: Mapping[str, Any]) -> int | None:
    """The k a speculators-format config.json proposes (speculators_config.proposal_methods[0]), or None."""
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or []
    return methods[0].get("speculative_tokens") if methods and isinstance(methods[0], dict) else None


def resolve_mask_token_id(mask_token_id: int | None, layer_config) -> int:
    """The token mask slots read: the one given, else the target's pad token, else its last vocabulary id;
    ValueError when outside the vocabulary (P-EAGLE's depths >= 1, DFlash's block slots)."""
    vocab = layer_config.vocab_size
    mask = mask_token_id
    if mask is None:
        pad = getattr(layer_config, "pad_token_id", None)
        mask = int(pad) if isinstance(pad, int) and 0 <= pad < vocab else vocab - 1
    if not 0 <= int(mask) < vocab:
        raise ValueError(f"mask_token_id {mask} is outside the target's vocabulary of {vocab}")
    return int(mask)


def target_folder(target: TargetHead, kind: str) -> str:
    """The target's local folder a family sizes its layers from; ValueError for a head built without one."""
    if not target.model_dir:
        raise ValueError(f"{kind} sizes its layers from the target's config: build the TargetHead with "
                         "TargetHead.from_model_dir(target_folder)")
    return target.model_dir
