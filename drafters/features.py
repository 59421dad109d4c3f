"""What a drafter family reads from a run, as data (SpecForge's FeatureContract is the picture). Each family module
declares `FEATURES = Features(...)`, which its Drafter (`Drafter.features`) and its registry entry (`Family.features`)
carry; the questions asked of a run are pure functions of it (no torch, no model code).

    Features(aux_layers, last_layer, top_k, loss_mask)   the declaration (fields below)
    features.required_layer_ids(n, aux_layer_ids)        the layers a run must hold: the configured aux ids, then N
                                                         (Drafter.required_layer_ids)
    features.extraction_layer_ids(n, aux_layer_ids)      the layers an extraction for the family captures: the aux
                                                         ids (configured, else aux_layer_spread), then N
    aux_layer_spread(n, count)                           the aux layers proposed for a target of n layers (3: EAGLE-3's
                                                         2, N//2, N-3)
    run_fit(features, spec, aux_layer_ids)               a run against a family: RunFit(needed, missing, top_k_refused,
                                                         suggested), for the trainer's check to word
    union_layer_ids(n, features)                         the layers that serve every family given (`hsx run`'s default
                                                         over the registry: drafters.registry.default_layer_ids)
    aux_layers_for_run(spec, aux_layer_ids, kind=, uses=, suggest=)   the aux layers a fusing family trains on,
                                                         checked against the run (Drafter.for_run)

Layer ids are vLLM's (0 = embeddings, k = output of decoder layer k-1, N = the last layer, pre-norm). A top-k target
run (`hsx run --target top_k:K`) keeps the target's top-K next-token log-probabilities in place of layer N: only a
family that reads N as its teacher's distribution (top_k=True) trains on one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Features:
    """What one family reads from a run."""

    aux_layers: int | None = None
    """Aux layers (states of layers before N) it fuses, as many as an extraction for it captures when none are
    configured (aux_layer_spread); None: it reads no aux layer. Training takes the configured aux_layer_ids, else
    every stored layer but N, whatever their number."""
    last_layer: bool = True
    """Whether it reads layer N (pre-norm): as its input (EAGLE, Medusa, MLPSpeculator) or as the teacher's
    distribution through the target's head (EAGLE-3, P-EAGLE, DFlash)."""
    top_k: bool = False
    """Whether a top-k target may stand in for layer N: True only where N is read as the teacher's distribution."""
    loss_mask: bool = True
    """Whether it trains only on positions whose token has loss_mask 1 (a run without masks trains every token)."""

    def __post_init__(self) -> None:
        if self.aux_layers is not None and (isinstance(self.aux_layers, bool) or not isinstance(self.aux_layers, int)
                                            or self.aux_layers < 1):
            raise ValueError(f"aux_layers must be None (no aux layers) or an integer >= 1, got {self.aux_layers!r}")
        if not self.last_layer and self.aux_layers is None:
            raise ValueError("a family reads aux layers, layer N or both: aux_layers is None and last_layer False")
        if self.top_k and not self.last_layer:
            raise ValueError("top_k=True stands a top-k target in for layer N, which this family does not read")

    def required_layer_ids(self, num_hidden_layers: int, aux_layer_ids: Sequence[int] | None = None
                           ) -> tuple[int, ...]:
        """The layers a run must hold: the configured aux ids (none when None: the run's own are taken), then N
        when the family reads it."""
        last = (int(num_hidden_layers),) if self.last_layer else ()
        return tuple(dict.fromkeys((*(int(i) for i in aux_layer_ids or ()), *last)))

    def extraction_layer_ids(self, num_hidden_layers: int, aux_layer_ids: Sequence[int] | None = None
                             ) -> tuple[int, ...]:
        """The layers an extraction for this family captures: the configured aux ids, else aux_layer_spread of
        `aux_layers` (none when None), then N when it reads it."""
        n = int(num_hidden_layers)
        aux = tuple(aux_layer_ids or ()) or (aux_layer_spread(n, self.aux_layers) if self.aux_layers else ())
        return self.required_layer_ids(n, aux)


def aux_layer_spread(num_hidden_layers: int, count: int = 3) -> tuple[int, ...]:
    """`count` aux layers spread over a target of n layers, clamped to 0..n and deduplicated (tiny targets repeat
    ids): 3 is EAGLE-3's choice (2, N//2, N-3); other counts are evenly spaced over 1..N-1."""
    n = int(num_hidden_layers)
    if count == 3:
        picks = (2, n // 2, n - 3)
    else:
        picks = tuple(round(1 + j * (n - 2) / max(1, count - 1)) for j in range(count))
    return tuple(dict.fromkeys(min(max(i, 0), n) for i in picks))


def union_layer_ids(num_hidden_layers: int, features: Iterable[Features]) -> tuple[int, ...]:
    """The layers that serve every family given: each one's proposed aux layers (aux_layer_spread), in order of
    first mention, then N when any reads it, deduplicated (for today's families: 2, N//2, N-3, N)."""
    n = int(num_hidden_layers)
    features = list(features)
    aux = [i for f in features if f.aux_layers for i in aux_layer_spread(n, f.aux_layers)]
    last = [n] if any(f.last_layer for f in features) else []
    return tuple(dict.fromkeys([*aux, *last]))


@dataclass(frozen=True)
class RunFit:
    """A run against a family: what it needs, what is missing, and whether its top-k target is refused."""

    needed: tuple[int, ...]
    """The layers the run must store (N left out when a top-k target stands in for it)."""
    missing: tuple[int, ...]
    """Those of `needed` the run does not store."""
    top_k_refused: bool
    """The run keeps a top-k target in place of N and the family reads N's state itself."""
    suggested: tuple[int, ...]
    """The run's layers and the needed ones, sorted: what to re-extract with (--layers)."""

    @property
    def ok(self) -> bool:
        return not self.missing and not self.top_k_refused


def run_fit(features: Features, spec: Any, aux_layer_ids: Sequence[int] | None = None) -> RunFit:
    """How a run fits a family. spec: a connectors.run.RunSpec (or anything with layer_ids, num_hidden_layers and
    target_top_k); aux_layer_ids: the family's configured aux layers (None: the run's own, not checked here)."""
    n = int(spec.num_hidden_layers)
    stored = tuple(spec.layer_ids)
    need = features.required_layer_ids(n, aux_layer_ids)
    top_k = getattr(spec, "target_top_k", None) is not None
    refused = top_k and features.last_layer and not features.top_k
    if top_k:
        need = tuple(i for i in need if i != n)  # the top-k target stands in for N
    missing = tuple(i for i in need if i not in stored)
    return RunFit(need, missing, refused, tuple(sorted({*stored, *need})))


def aux_layers_for_run(run_spec: Any, aux_layer_ids: Sequence[int] | None, *, kind: str, uses: str,
                       suggest: Sequence[int]) -> tuple[int, ...]:
    """The aux layers a family fusing them trains on (aux_layer_ids, else every stored layer but N), checked against
    the run: it must hold them and N (a top-k target stands in for N); ValueError naming the re-extraction otherwise.
    `uses`: what the family does with them, for the message; `suggest`: the layers to propose (those in 1..N).
    Ascending whatever order the run or aux_layer_ids lists them in: vLLM captures aux layers in ascending order
    (SupportsEagle3 keeps sorted(set(ids))) and feeds them to the head's fc so; a head trained on [29, 16, 2] would
    be served its inputs permuted, silently."""
    n = int(run_spec.num_hidden_layers)
    stored = tuple(run_spec.layer_ids)
    aux = tuple(aux_layer_ids or ()) or tuple(i for i in stored if i != n)
    suggestion = ",".join(str(i) for i in sorted(set(suggest)) if 0 < i <= n)
    if not aux:
        raise ValueError(f"{kind} {uses}, but the run stores only layers {list(stored)}; re-extract with aux layers, "
                         f"e.g. --layers {suggestion}")
    have = (*stored, n) if run_spec.target_top_k is not None else stored
    missing = [i for i in (*aux, n) if i not in have]
    if missing:
        raise ValueError(f"{kind} needs layers {list(Features(aux_layers=len(aux)).required_layer_ids(n, aux))} but "
                         f"the run stores {list(stored)} (missing {missing}); re-extract with --layers {suggestion} or "
                         "pass aux_layer_ids the run holds")
    return tuple(sorted(aux))
