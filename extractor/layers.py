"""Layer ids and the capture hooks — the `extract_hidden_states` pseudo-drafter.

Ids follow vLLM's convention (the one stored in every file):
    0        the embedding output = the input of decoder layer 0 (position embeddings and scaling included)
    k        the output of decoder layer k-1: the residual stream, before any final norm
    N        the output of the last decoder layer, pre-norm (HF's hidden_states[N] is post-norm; we never use it)

`LayerCapture` hooks the decoder layers themselves, so it sees exactly those tensors, keeps only the chosen ids
(never all N+1), and can stop the forward right after the deepest one (early exit, for prompt-only extraction).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

# Families the engine is tested on; others work when their decoder layers are found the same way.
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt2")
_LAYER_NAMES = frozenset({"layers", "h", "blocks"})
_NOT_THE_DECODER = frozenset({"vision_tower", "vision_model", "visual", "vision", "audio_tower", "audio_model",
                              "mtp", "multi_modal_projector"})
"""Module names on the path to a ModuleList that make it some other stack than the text decoder's."""


def default_layer_ids(num_hidden_layers: int) -> tuple[int, ...]:
    """EAGLE-3's aux layers [2, N//2, N-3] plus the last layer N, deduplicated (tiny models repeat ids)."""
    n = num_hidden_layers
    ids: list[int] = []
    for i in (2, n // 2, n - 3, n):
        i = min(max(i, 0), n)
        if i not in ids:
            ids.append(i)
    return tuple(ids)


def find_decoder_layers(model: nn.Module, num_hidden_layers: int) -> nn.ModuleList:
    """The ModuleList of decoder layers of a HF causal LM, wherever the architecture keeps it."""
    return find_decoder(model, num_hidden_layers)[2]


def find_decoder(model: nn.Module, num_hidden_layers: int) -> tuple[str, nn.Module, nn.ModuleList]:
    """(qualified name of the module that holds the decoder layers, that module, the layers): the ModuleList of
    `num_hidden_layers` modules named layers / h / blocks, outside any vision, audio or multi-token-prediction part.
    Found by structure, not by the model's class: `base_model` is only a hint (for Llama-4's text model it is the
    CausalLM itself), so the whole module tree is searched and exactly one list must qualify."""
    found = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if child_name in _LAYER_NAMES and isinstance(child, nn.ModuleList) and len(child) == num_hidden_layers \
                    and not (set(name.split(".")) & _NOT_THE_DECODER):
                found.append((name, module, child, f"{name}.{child_name}" if name else child_name))
    if len(found) > 1:  # a wrapper that repeats the decoder under two names: the one base_model names
        base = getattr(model, "base_model", model)
        found = [f for f in found if f[1] is base] or found
    if len(found) == 1:
        return found[0][:3]
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: "
                     + (f"several ModuleLists of {num_hidden_layers} layers qualify ({[f[3] for f in found]})"
                        if found else f"no ModuleList of {num_hidden_layers} modules named {sorted(_LAYER_NAMES)}")
                     + f"; hsx supports decoder-only HF causal LMs such as {', '.join(SUPPORTED_FAMILIES)}")


class EarlyExit(Exception):
    """Raised by a hook after the deepest requested layer, to skip the rest of the forward."""


def _hidden(x):
    return x[0] if isinstance(x, (tuple, list)) else x


class LayerCapture:
    """Forward hooks that keep chosen hidden-state ids.

        begin(early_exit)  arm for one forward
        end()              disarm (the runner calls it after every forward, failed or not)
        collect()          -> [B, S, L, H] in layer-id order given at construction
        close()            remove the hooks
    """

    def __init__(self, layers: nn.ModuleList, layer_ids: Sequence[int]) -> None:
        self.layer_ids = tuple(layer_ids)
        self.deepest = max(self.layer_ids)
        self._buf: dict[int, torch.Tensor] = {}
        self._early_exit = False
        self.enabled = True
        self._handles = []
        if 0 in self.layer_ids:
            self._handles.append(layers[0].register_forward_pre_hook(self._pre_hook_embeddings, with_kwargs=True))
        for i in self.layer_ids:
            if i > 0:
                self._handles.append(layers[i - 1].register_forward_hook(self._make_hook(i)))

    def _keep(self, layer_id: int, hidden: torch.Tensor) -> None:
        if not self.enabled:
            return
        self._buf[layer_id] = hidden
        if self._early_exit and layer_id == self.deepest:
            raise EarlyExit

    def _pre_hook_embeddings(self, module, args, kwargs):
        self._keep(0, args[0] if args else kwargs["hidden_states"])

    def _make_hook(self, layer_id: int):
        def hook(module, args, output):
            self._keep(layer_id, _hidden(output))
        return hook

    def begin(self, early_exit: bool = False) -> None:
        self._buf.clear()
        self._early_exit = early_exit

    def end(self) -> None:
        """Disarm early exit, so a forward outside the engine (or after a failed one) runs to the end."""
        self._early_exit = False

    def collect(self) -> torch.Tensor:
        missing = [i for i in self.layer_ids if i not in self._buf]
        if missing:
            raise RuntimeError(f"layer ids {missing} were not captured in this forward; the model skipped their "
                               "decoder layers (internal error)")
        out = torch.stack([self._buf[i] for i in self.layer_ids], dim=2)  # [B, S, L, H]
        self._buf.clear()
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
