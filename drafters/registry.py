"""The drafter families: one registry (extractor.methods), read by the trainer, the evaluator and the engine.

    Family(name, description, drafter=, proposer_class=, config_matches=, config_k=, options=, parallel_of=,
           parallel=, features=)
        one family: its Drafter (training/trainer.py trains it), its Proposer (the engine decodes with it), how to
        recognise its checkpoints, what it reads from a run (drafters.features.Features); classes named
        "module:Class" and imported when used
    families() / family(name) / register(family) / unregister(name)   extractor.methods' registry
    drafter_class(name)                             the family's Drafter subclass, or ValueError naming the choices
    trainable_families()                            the families that train a new head for any target (not mtp)
    family_features(name)                           the family's Features, or ValueError naming the choices
    default_layer_ids(n)                            the layers that serve every registered family (`hsx run` with
                                                    no --layers: 2, N//2, N-3, N for hsx's own families)

Adding a family is its modules (drafters/<name>.py: config, Drafter, checkpoint, FEATURES and `FAMILY =
Family(...)`; drafters/<name>_proposer.py: its Proposer) and one entry point in pyproject.toml
(`[project.entry-points."hsx.drafters"]  name = "drafters.name:FAMILY"`); see docs/drafters.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from drafters.features import Features, union_layer_ids
from extractor.methods import families, family, register, unregister

__all__ = ["Family", "families", "family", "register", "unregister", "drafter_class", "trainable_families",
           "family_features",
           "default_layer_ids", "load"]


def load(ref: str) -> Any:
    """The object "module:Name" names."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Family:
    name: str
    """The speculative_config method and `hsx train-drafter --kind`."""
    description: str
    """What its checkpoint is, for messages."""
    drafter: str
    """"module:Class" of its drafters.base.Drafter subclass."""
    proposer_class: str
    """"module:Class" of its Proposer: Class(model_dir, runner, k)."""
    config_matches: Callable[[dict[str, Any]], bool]
    """Whether a checkpoint's config.json is this family's."""
    config_k: Callable[[dict[str, Any]], int | None] = lambda config: None
    """The k a checkpoint's config.json says it was built for, or None."""
    options: tuple[str, ...] = ()
    """TrainDrafterConfig fields only this family takes (EAGLE-3: draft_vocab_size, ttt_steps)."""
    parallel_of: str | None = None
    """The method whose `parallel_drafting: true` this family's checkpoints serve (P-EAGLE: "eagle3", as vLLM runs
    them)."""
    parallel: bool = False
    """Whether it drafts all k tokens in one forward (P-EAGLE, DFlash): parallel_drafting is accepted (and implied)
    for it, refused for the others."""
    features: Features = Features()
    """What it reads from a run (aux layers, layer N, a top-k target in N's place, loss masks); the default: layer N
    alone, as Medusa and MLPSpeculator."""
    model_optional: bool = False
    """Whether its draft lives in the target's own folder (mtp: the target's MTP layers), so speculative_config may
    leave out 'model', as vLLM; such a family tunes a target's own layers rather than training a head for any
    target."""

    preflight: str | None = None
    """"module:function" of a check of a draft folder against its target before any engine loads (function(model_dir,
    target_dir) raising ValueError in one line): MTP's, that the tensors its config declares are there and were made
    for that target. Every family also gets check_against's config check (sizes and aux layers its config records)."""

    def matches(self, checkpoint_config: dict[str, Any]) -> bool:
        return bool(self.config_matches(checkpoint_config))

    def check_against(self, model_dir: str, target_dir: str, target_config) -> None:
        """ValueError (one line) when the draft at `model_dir` cannot serve the target `target_dir` (transformers text
        config `target_config`): the sizes and aux layers its config.json records, then the family's preflight."""
        from drafters.base import read_checkpoint_json  # torch: the registry itself stays light

        why = draft_target_mismatch(read_checkpoint_json(model_dir, self.name), target_config)
        if why:
            raise ValueError(f"the {self.name} draft {model_dir} {why}: it was trained for another target; train one "
                             f"on a run of {target_dir}")
        if self.preflight:
            load(self.preflight)(model_dir, target_dir)

    def num_speculative_tokens(self, checkpoint_config: dict[str, Any]) -> int | None:
        k = self.config_k(checkpoint_config)
        return k if isinstance(k, int) and not isinstance(k, bool) else None

    def proposer(self, model_dir: str, runner, k: int):
        return load(self.proposer_class)(model_dir, runner, k)

    def drafter_class(self) -> type:
        return load(self.drafter)


def draft_target_mismatch(config: dict[str, Any], target_config) -> str | None:
    """What a draft checkpoint's config.json records of the target it was trained for that differs from
    `target_config` (its hidden size, vocabulary, aux layer ids past the target's last layer), or None; keys every
    family's layout uses (speculators' target_hidden_size and transformer_layer_config, Medusa's hidden_size,
    MLPSpeculator's emb_dim, the aux-layer lists)."""
    layer = config.get("transformer_layer_config") if isinstance(config.get("transformer_layer_config"), dict) else {}
    hidden = config.get("target_hidden_size") or config.get("emb_dim") or layer.get("hidden_size") \
        or config.get("hidden_size")
    vocab = layer.get("vocab_size") or config.get("vocab_size")
    want_h, want_v, n = (getattr(target_config, k, None) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    if isinstance(hidden, int) and isinstance(want_h, int) and hidden != want_h:
        return f"reads states {hidden} wide, the target's are {want_h}"
    if isinstance(vocab, int) and isinstance(want_v, int) and vocab != want_v:
        return f"has a vocabulary of {vocab}, the target's is {want_v}"
    aux = config.get("eagle_aux_hidden_state_layer_ids") or config.get("aux_hidden_state_layer_ids") or []
    if not isinstance(n, int):
        return None
    bad = [i for i in aux if not isinstance(i, int) or not 0 <= i <= n] if isinstance(aux, list) else [aux]
    if bad:
        return f"reads layers {aux}, the target has layer ids 0..{n}"
    return None


def drafter_class(name: str) -> type:
    """The Drafter subclass of family `name` (imported now)."""
    found = family(name)
    if found is None:
        raise ValueError(f"--kind {name!r} is not a drafter family; choose one of {sorted(families())}")
    if not hasattr(found, "drafter_class"):
        raise ValueError(f"--kind {name}: this family can decode but not be trained by hsx (it has no Drafter)")
    try:
        cls = found.drafter_class()
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--kind {name}: {getattr(found, 'drafter', name)} is not available in this hsx ({e})") from e
    declared = getattr(found, "features", None) or Features()
    if getattr(cls, "features", declared) != declared:  # the trainer's checks read one, the Drafter the other
        raise ValueError(f"--kind {name}: its Family declares {declared} but its Drafter {cls.__name__} declares "
                         f"{cls.features}; a family declares what it reads once (FEATURES, passed to both)")
    return cls


def trainable_families() -> list[str]:
    """The registered families that train a new head on a run of any target (a Drafter of their own), sorted; mtp,
    which fine-tunes a target's own MTP layers, is not among them."""
    return sorted(name for name, found in families().items()
                  if hasattr(found, "drafter_class") and not getattr(found, "model_optional", False))


def family_features(name: str) -> Features:
    """What family `name` reads from a run (its Family.features; Features() for a family registered without them)."""
    found = family(name)
    if found is None:
        raise ValueError(f"--kind {name!r} is not a drafter family; choose one of {sorted(families())}")
    return getattr(found, "features", None) or Features()


def default_layer_ids(num_hidden_layers: int) -> tuple[int, ...]:
    """The layers a run must store to train every registered family (their proposed aux layers, then N): `hsx
    run`'s default when --layers is not given."""
    return union_layer_ids(num_hidden_layers, (family_features(name) for name in sorted(families())))
