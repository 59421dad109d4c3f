"""Packed prefill: the prompts of a prompt-only batch end to end in one row, no padding, attention kept within each
prompt and positions restarting at 0 for each.

    packing_refusal(model, inner)     why a loaded target cannot be packed (one line), None where it can
    Packer(model, base, inner)        one runner's packing
        .inputs(rows, device)         ids [1, T], positions [1, T] and each prompt's first column
        .active(starts, lengths)      context: the model's attention runs per prompt for one forward
        .probe(pad, device, vocab, ...) one line where a small packed forward's states differ from the padded one's
    PACKED_ATTENTION                  the attention implementation registered with transformers for it

How: for the forward, the model's attention implementation is switched to PACKED_ATTENTION, a function registered in
transformers' AttentionInterface. transformers builds no mask for an implementation it does not know (so no
[T, T] mask of the packed row is ever made), and every attention layer hands this function its query, key and value
for the whole row; it runs the model's own implementation (sdpa or eager) on each prompt's slice with exactly the
mask the padded path would give that prompt alone (causal, or causal within the layer's sliding window; built by
transformers' own mask functions), and puts the outputs back end to end. (On CUDA in half precision an sdpa layer
without extras such as soft-capping or sinks runs every prompt in one call of torch's variable-length flash attention,
torch.nn.attention.varlen, instead of one call per prompt.) Everything else in a decoder (projections,
MLPs, MoE routing, norms) works token by token, so the padded tokens' compute is simply gone; attention costs
sum(L_i^2) instead of B * max(L)^2. A flash-attention model needs no switch: transformers' flash path already reads
packed prompts from position ids that restart.

A target packs only where that is exact: every cache layer a plain attention one (full or sliding window; linear
attention and state-space layers carry state along the row, chunked attention is fixed to absolute positions), a
text target (image prompts carry M-RoPE positions and vision features per row), an attention implementation this
module runs per prompt, and a probe at load that agrees (Packer.probe: three short prompts packed, checked for leaks
across prompts at every layer and against the padded batch's states). Where any of these fails, the engine pads as
before (EngineConfig.packing "auto") or refuses ("on").
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

PACKED_ATTENTION = "hsx_packed"
PER_PROMPT = ("sdpa", "eager")
"""Attention implementations run prompt by prompt inside the packed row."""
NATIVE = ("flash_attention_2", "flash_attention_3")
"""Implementations that read packed prompts from restarting position ids themselves (transformers' varlen path)."""
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
"""Largest relative difference (per prompt and layer) the probe allows; half-precision dtypes get HALF_TOLERANCE. A
leak across prompts changes states by tens of percent, rounding by far less."""
HALF_TOLERANCE = 2e-2
HALF_AGREEMENT_LAYERS = 3
"""In half precision the probe compares packed with padded states at hidden states 0..2 only (the embeddings, where
wrong positions show, and the first layers, before rounding compounds and a MoE's routing can flip); every layer is
checked for leaks by the packed row against itself, with only the first prompt's tokens changed."""
ATTENTION_TYPES = {"full_attention", "sliding_attention"}
"""Layer types packing reproduces: causal attention, alone or within a sliding window."""


@dataclass
class _Segments:
    """The packed row of the forward running now: prompt b is columns [bounds[b][0], bounds[b][1])."""

    bounds: list[tuple[int, int]]
    inner: str
    masks: dict = field(default_factory=dict)
    windows: list[int | None] = field(default_factory=list)
    """Each attention call's sliding window (None: full attention), in call order."""
    varlen_calls: int = 0
    _cumulative: tuple | None = None

    def cumulative(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """(each prompt's first column and the row's end, int32 [N + 1] on `device`; the longest prompt)."""
        if self._cumulative is None:
            starts = [lo for lo, _ in self.bounds] + [self.bounds[-1][1]]
            self._cumulative = (torch.tensor(starts, dtype=torch.int32, device=device),
                                max(hi - lo for lo, hi in self.bounds))
        return self._cumulative

    def mask(self, length: int, window: int | None, dtype: torch.dtype, device: torch.device):
        """The mask the padded path gives one prompt of `length` tokens alone (None: sdpa's causal fast path)."""
        key = (length, window, dtype, device)
        if key not in self.masks:
            from transformers.masking_utils import (
                ALL_MASK_ATTENTION_FUNCTIONS,
                causal_mask_function,
                sliding_window_causal_mask_function,
            )

            function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
            self.masks[key] = ALL_MASK_ATTENTION_FUNCTIONS[self.inner](
                batch_size=1, q_length=length, kv_length=length, q_offset=0, kv_offset=0, mask_function=function,
                attention_mask=None, allow_is_causal_skip=True, local_size=window, dtype=dtype, device=device)
        return self.masks[key]


_ACTIVE: ContextVar[_Segments | None] = ContextVar("hsx_packed_segments", default=None)


def _inner_function(module: torch.nn.Module, inner: str) -> Callable:
    """The attention function the model runs for `inner`: its own module's eager_attention_forward (models keep
    their variants there: soft-capping, attention sinks), or transformers' registered one."""
    if inner == "eager":
        function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if function is None:
            raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward beside it (internal error: "
                               "packing should have been refused at load)")
        return function
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[inner]


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for a packed row: query / key / value [1, heads, T, D]; each prompt's slice
    through the model's own implementation with its own mask; output [1, T, heads, D]."""
    segments = _ACTIVE.get()
    if segments is None:
        raise RuntimeError(f"attention implementation {PACKED_ATTENTION!r} outside a packed forward (internal error)")
    total = segments.bounds[-1][1]
    if query.shape[0] != 1 or query.shape[2] != total or key.shape[2] != total:
        raise RuntimeError(f"packed attention got query {tuple(query.shape)} / key {tuple(key.shape)} for a packed "
                           f"row of {total} tokens (internal error: a cache or a batch in a packed forward)")
    inner = _inner_function(module, segments.inner)
    window = kwargs.get("sliding_window")
    segments.windows.append(window)
    if _varlen_fits(query, key, value, segments.inner, kwargs):
        return _varlen(query, key, value, segments, window, kwargs.get("scaling")), None
    outputs = []
    for lo, hi in segments.bounds:
        mask = segments.mask(hi - lo, window, query.dtype, query.device)
        out, _ = inner(module, query[:, :, lo:hi], key[:, :, lo:hi], value[:, :, lo:hi], mask, **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


VARLEN_DTYPES = (torch.float16, torch.bfloat16)


def _varlen_fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, inner: str, kwargs: dict) -> bool:
    """Whether one call of torch's variable-length flash attention computes this layer exactly as sdpa per prompt
    would: CUDA, half precision, one head size, none of the extras flash does not take (soft-capping, sinks, a
    bias)."""
    if inner != "sdpa" or not query.is_cuda or query.dtype not in VARLEN_DTYPES:
        return False
    if any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "sinks", "position_bias")):
        return False
    if not query.shape[-1] == key.shape[-1] == value.shape[-1] or query.shape[-1] > 256:
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401 - torch >= 2.9
    except ImportError:
        return False
    return True


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: _Segments, window: int | None,
            scaling: float | None) -> torch.Tensor:
    """Every prompt of the packed row in one varlen flash-attention call (one kernel per layer, not one per prompt):
    causal, or causal within `window` keys (transformers' sliding window counts the query's own key)."""
    from torch.nn.attention.varlen import varlen_attn

    cu, longest = segments.cumulative(query.device)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, heads, D]
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling,
                      window_size=(-1, 0) if window is None else (window - 1, 0), enable_gqa=q.shape[1] != k.shape[1])
    segments.varlen_calls += 1
    return out[None]  # [1, T, heads, D]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def config_packing_refusal(config) -> str | None:
    """Why a target of this transformers config can never be packed (one line), or None: read from the config
    alone, so a plan refuses `--packing on` before any worker loads the model."""
    from extractor.media import is_multimodal
    from extractor.rollback import FULL, SLIDING, cache_kinds

    if is_multimodal(config):
        return "image targets carry per-row positions and vision features"
    kinds = cache_kinds(config)
    other = sorted({k for k in kinds if k not in (FULL, SLIDING)})
    if other:
        return f"its cache holds {', '.join(other)} layers, which carry state along a row"
    types = sorted(set(getattr(config.get_text_config(), "layer_types", None) or ()) - ATTENTION_TYPES)
    if types:
        return f"its {', '.join(types)} layers mask by more than causality and a window"
    return None


def check_packing_mode(hf_config, mode: str, model: str, flag: str = "--packing") -> None:
    """ValueError (one line) for packing "on" on a target that can never pack (config_packing_refusal): what a plan
    checks before any worker loads the model."""
    why = config_packing_refusal(hf_config) if mode == "on" else None
    if why:
        kind = getattr(hf_config.get_text_config(), "model_type", None) or getattr(hf_config, "model_type", "?")
        raise ValueError(f"{flag} on but {model} ({kind}) cannot pack prompts: {why}; use {flag} auto (padded "
                         "batches where packing does not apply) or off")


def packing_refusal(model: torch.nn.Module, inner: str | None) -> str | None:
    """Why this loaded target's prompts cannot be packed (one line), or None: they can, if the probe agrees."""
    why = config_packing_refusal(model.config)
    if why is not None:
        return why
    if inner not in PER_PROMPT + NATIVE:
        return f"attention implementation {inner!r} is not one packing runs ({', '.join(PER_PROMPT + NATIVE)})"
    if inner == "eager":
        missing = sorted({type(m).__name__ for m in model.modules() if _is_attention(m)
                          and getattr(sys.modules.get(type(m).__module__), "eager_attention_forward", None) is None})
        if missing:
            return f"eager attention of {', '.join(missing)} is not found beside it"
    return None


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _configs(config) -> list:
    """A config and its sub-configs, all levels (what transformers' _attn_implementation setter walks)."""
    out = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation_internal"):
            out += _configs(sub)
    return out


def rope_length_limit(text) -> int | None:
    """The prompt length from which a model's RoPE frequencies depend on the forward's largest position id (longrope:
    its long factors past original_max_position_embeddings; dynamic NTK: scaled past max_position_embeddings), or
    None. Below it a prompt gets the same frequencies packed beside others as alone."""
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    entries = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    limits = []
    for entry in entries:
        kind = str(entry.get("rope_type") or entry.get("type") or "")
        if "longrope" in kind:
            limits.append(entry.get("original_max_position_embeddings")
                          or getattr(text, "original_max_position_embeddings", None))
        elif "dynamic" in kind:
            limits.append(getattr(text, "max_position_embeddings", None))
    limits = [n for n in limits if isinstance(n, int) and n > 0]
    return min(limits) if limits else None


def _is_attention(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("Attention") and hasattr(module, "config")


class Packer:
    """Packed prefill for one loaded model (attention implementation `inner`: what its config says)."""

    def __init__(self, model: torch.nn.Module, base: torch.nn.Module, inner: str) -> None:
        from extractor.rollback import SLIDING, cache_kinds

        self.model, self.base, self.inner = model, base, inner
        self.sliding_layers = cache_kinds(model.config).count(SLIDING)
        self.max_prompt_tokens = rope_length_limit(model.config.get_text_config())
        """Prompts this long or longer are never packed (None: no such limit): RoPE that picks its frequencies from
        the forward's largest position (longrope, dynamic NTK) must see each packed prompt as it sees it alone."""
        if inner in PER_PROMPT:
            _register()

    @staticmethod
    def inputs(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The packed row: ids [1, T], positions [1, T] (0.. for each prompt), and where each prompt starts."""
        starts, total = [], 0
        for r in rows:
            starts.append(total)
            total += len(r)
        ids = torch.tensor([t for r in rows for t in r], dtype=torch.long)[None]
        positions = torch.cat([torch.arange(len(r), dtype=torch.long) for r in rows])[None]
        return ids.to(device), positions.to(device), starts

    @contextlib.contextmanager
    def active(self, starts: list[int], lengths: list[int]) -> Iterator[_Segments]:
        """For one forward of a packed row: attention per prompt (the model's implementation switched, then
        restored)."""
        segments = _Segments([(s, s + n) for s, n in zip(starts, lengths)], self.inner)
        if self.inner not in PER_PROMPT:  # flash attention: packed prompts read from the position ids
            yield segments
            return
        configs = _configs(self.model.config)
        saved = [c._attn_implementation for c in configs]
        token = _ACTIVE.set(segments)
        self.model.config._attn_implementation = PACKED_ATTENTION  # transformers sets the sub-configs' too
        try:
            yield segments
        finally:
            for config, value in zip(configs, saved):  # each back to its own (a sub-config may have had another)
                config._attn_implementation_internal = value
            _ACTIVE.reset(token)

    @torch.inference_mode()
    def probe(self, pad: Callable, device: torch.device, vocab_size: int, dtype: torch.dtype, window: int | None
              ) -> str | None:
        """`pad`: the runner's ModelRunner.pad (the padded batch the engine would run). Three short prompts (one longer than a short sliding window) through the model packed: one line saying
        where packing is not exact, or None. Checks: every layer of the packed row against the same row with the first
        prompt's tokens changed (a leak across prompts changes the others); the packed states against the padded
        batch's (all layers in float32, the first HALF_AGREEMENT_LAYERS in half precision: positions, masks); every
        sliding-window layer handing the attention function its window, the config's."""
        lengths = [11, 5, 8]
        if window is not None and window < 32:
            lengths[0] = window + 3  # the window is crossed inside the packed row
        g = torch.Generator().manual_seed(0)
        rows = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]
        padded_ids, _, padded_positions, _ = pad(rows, left=False)
        padded = self._states(padded_ids, padded_positions)
        ids, positions, starts = self.inputs(rows, device)
        with self.active(starts, lengths) as segments:
            packed = self._states(ids, positions)
        other = ids.clone()
        other[0, :lengths[0]] = (other[0, :lengths[0]] + 1 + torch.arange(lengths[0], device=device)) % vocab_size
        with self.active(starts, lengths):
            changed = self._states(other, positions)
        if self.inner in PER_PROMPT:
            if not segments.windows:
                return "its attention does not go through transformers' attention interface"
            told = [w for w in segments.windows if w is not None]
            if len(told) != self.sliding_layers:
                return (f"its sliding-window layers do not hand the attention function their window ({len(told)} "
                        f"calls did, for {self.sliding_layers} sliding layers)")
            if told and set(told) != {window}:
                return (f"its layers hand the attention function windows {sorted(set(told))}, not the config's "
                        f"sliding_window {window}")
        tolerance = PROBE_TOLERANCE.get(dtype, HALF_TOLERANCE)
        agreement = len(packed) if dtype in PROBE_TOLERANCE else HALF_AGREEMENT_LAYERS
        for layer, (p, c, u) in enumerate(zip(packed, changed, padded)):
            for b, (s, n) in enumerate(zip(starts, lengths)):
                got = p[0, s:s + n].float()
                if b > 0 and _relative(c[0, s:s + n].float(), got) > tolerance:
                    return (f"a probe's prompt {b} changed with the tokens of prompt 0 packed before it, at hidden "
                            f"state {layer}: attention (or another layer) reaches across prompts")
                rel = _relative(got, u[b, :n].float())
                if layer < agreement and not rel <= tolerance:
                    return (f"a probe's packed states differ from the padded ones at hidden state {layer}, prompt {b} "
                            f"(relative {rel:.1e} > {tolerance:.0e})")
        return None

    def _states(self, ids: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        out = self.base(input_ids=ids, position_ids=positions, attention_mask=None, use_cache=False,
                        output_hidden_states=True)
        states = getattr(out, "hidden_states", None)
        return list(states) if states else [out.last_hidden_state]
