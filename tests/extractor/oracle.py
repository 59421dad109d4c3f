"""The independent oracle: a plain, single-request transformers forward of the same tokens.

HF's `hidden_states[k]` is vLLM id k for k < N; HF's `hidden_states[N]` is post-norm, so the pre-norm id N comes
from a second forward with the final norm replaced by Identity. Nothing here uses hsx's hooks.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

_FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


ENGINE_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""The device an engine built without `device=` runs on."""


def load_reference(model_dir: str, dtype: torch.dtype = torch.float32, device: str = ENGINE_DEVICE):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    no_norm = copy.deepcopy(model)
    base = no_norm.base_model
    for name in _FINAL_NORMS:
        if isinstance(getattr(base, name, None), nn.Module):
            setattr(base, name, nn.Identity())
            break
    else:
        raise AssertionError(f"oracle does not know the final norm of {type(model).__name__}")
    return model, no_norm


@torch.no_grad()
def reference_states(ref, token_ids, layer_ids) -> torch.Tensor:
    """[T, L, H] on the CPU for `token_ids`, one standalone forward, no padding, no batching, on the model's device."""
    model, no_norm = ref
    ids = torch.as_tensor(token_ids, dtype=torch.long)[None].to(model.device)
    n = model.config.num_hidden_layers
    hs = model(ids, output_hidden_states=True).hidden_states
    last = no_norm(ids, output_hidden_states=True).hidden_states[n] if n in layer_ids else None
    rows = [last[0] if i == n else hs[i][0] for i in layer_ids]
    return torch.stack(rows, dim=1).cpu()


@torch.no_grad()
def reference_log_probs(ref, token_ids) -> torch.Tensor:
    """[T, V] next-token log-probabilities on the CPU for `token_ids`: one standalone forward on the model's device."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)[None].to(ref[0].device)
    return ref[0](ids).logits[0].float().log_softmax(-1).cpu()


def stop_string_cut(tokenizer, token_ids, stop: str) -> int:
    """How many of `token_ids` a greedy request with stop string `stop` keeps, as vLLM decides it: the first n whose
    text holds `stop` once that text ends in whole characters (a text ending in U+FFFD has an incomplete UTF-8
    character, which the next token may complete, so no stop is looked for there yet)."""
    for n in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:n], skip_special_tokens=True)
        if not text.endswith("\ufffd") and stop in text:
            return n
    raise AssertionError(f"{stop!r} is not in the decoded text of {token_ids}")
