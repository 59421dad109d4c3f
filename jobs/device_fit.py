"""What a target needs of a device, from its config alone (no weights read): `hsx estimate --device-memory`.

    device_fit(hf_config, dtype=, max_model_len=, max_num_batched_tokens=, max_num_seqs=, captured_layers=,
               device_memory=None, utilization=0.9) -> DeviceFit
    parse_size("80GiB") -> bytes

Weights: the model transformers builds from the config on the meta device (no memory), its parameters counted at the
run's dtype (a quantized checkpoint's dequantized size; its own format is smaller; a multimodal target's text model
only). Key/value cache: per token, each attention layer's keys and values (MLA: the latent vLLM caches; windowed and
chunked layers at most their window or chunk; linear-attention and convolution layers hold a state per sequence
instead, not counted), for what an engine needs to run at all: one sequence of max_model_len tokens, or one forward's
max_num_batched_tokens if more (vLLM fills the rest of the device with cache blocks). Activations: one forward of
max_num_batched_tokens tokens (a layer's working set, the captured layers until they are copied out, and the
generating rows' float32 logits). A rank of a tensor-parallel engine of size T holds 1/T of the weights, its share of
the key/value heads (at least one head; MLA's latent whole on every rank) and, conservatively, all the activations. The smallest T that fits `utilization` of the device (T divides the
attention heads, at most 8 on one node) names the engine: T = 1 runs in hsx's engine or vLLM, T > 1 only in vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cluster.progress import human_bytes

MAX_TP = 8
"""Largest tensor-parallel size considered: the devices of one node."""
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes of "80GiB", "141 GB", "24g" or "1073741824"; ValueError naming the forms taken."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"--device-memory {text!r}: give a size such as 80GiB, 141GB or 24G (or bytes)")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass
class DeviceFit:
    parameters: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    """For one sequence of max_model_len tokens (or one forward's tokens, if more)."""
    activation_bytes: int
    dtype: str
    device_memory: int | None = None
    utilization: float = 0.9
    tensor_parallel_size: int | None = None
    """Smallest T whose rank fits; None when no T <= MAX_TP does (or no device memory was given)."""
    per_rank_bytes: dict[int, int] = field(default_factory=dict)
    """T -> bytes a rank needs, for the sizes that divide the attention heads."""
    quantized: bool = False

    @property
    def engine(self) -> str:
        if self.tensor_parallel_size is None:
            return ""
        if self.tensor_parallel_size == 1:
            return "hsx's engine or --engine vllm"
        return f"--engine vllm --tensor-parallel-size {self.tensor_parallel_size} (hsx's engine runs on one device)"

    def lines(self) -> list[str]:
        out = [f"weights:  {human_bytes(self.weight_bytes)} ({self.parameters / 1e9:.3g}B parameters in {self.dtype}"
               + ("; the checkpoint is quantized: dequantized size" if self.quantized else "") + ")",
               f"kv cache: {human_bytes(self.kv_bytes_per_token)}/token, {human_bytes(self.kv_cache_bytes)} for one "
               "--max-model-len sequence (more sequences take what the device has left)",
               f"activ.:   {human_bytes(self.activation_bytes)} per forward of --max-num-batched-tokens"]
        if self.device_memory is not None:
            budget = int(self.device_memory * self.utilization)
            sizes = ", ".join(f"T={t}: {human_bytes(b)}" for t, b in self.per_rank_bytes.items())
            out.append(f"device:   {human_bytes(self.device_memory)} x {self.utilization:g} = {human_bytes(budget)} "
                       f"usable; per rank {sizes}")
            out.append(f"fits:     tensor-parallel size {self.tensor_parallel_size}: {self.engine}"
                       if self.tensor_parallel_size else
                       f"fits:     no tensor-parallel size up to {MAX_TP} (one node) fits; use larger devices, a "
                       "smaller --max-model-len / --max-num-seqs, or a quantized checkpoint")
        return out


_NO_KV = frozenset({"linear_attention", "conv", "mamba"})
"""transformers' layer_types that keep no per-token keys and values (a state per sequence instead)."""


def device_fit(hf_config, *, dtype: str, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
               captured_layers: int, device_memory: int | None = None, utilization: float = 0.9,
               trust_remote_code: bool = False) -> DeviceFit:
    """ValueError (one line) for a config transformers cannot build a causal LM of."""
    import torch
    from transformers import AutoModelForCausalLM

    from extractor.facts import text_config

    text = text_config(hf_config)
    size = getattr(torch, dtype).itemsize
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(text, trust_remote_code=trust_remote_code)
        parameters = sum(p.numel() for p in skeleton.parameters())
        del skeleton
        hidden, layers, vocab = int(text.hidden_size), int(text.num_hidden_layers), int(text.vocab_size)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--device-memory: transformers cannot build this model's text decoder from its config "
                         f"({type(e).__name__}: {e}); size it by hand") from None
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or (hidden // heads if heads else 0))
    kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * layers)
    mla = bool(getattr(text, "kv_lora_rank", None))
    if mla:  # vLLM caches the latent and the rotary part, once per layer, whole on every rank
        per_layer = int(text.kv_lora_rank) + int(getattr(text, "qk_rope_head_dim", 0) or 0)
    else:
        per_layer = 2 * kv_heads * head_dim
    tokens = max(max_model_len, max_num_batched_tokens)
    span = {"sliding_attention": getattr(text, "sliding_window", None), "hybrid_sliding":
            getattr(text, "sliding_window", None), "chunked_attention": getattr(text, "attention_chunk_size", None)}
    attention = [k for k in kinds if k not in _NO_KV]
    kv_per_token = len(attention) * per_layer * size
    kv_cache = sum(min(int(span.get(k) or tokens), tokens) for k in attention) * per_layer * size
    intermediate = int(getattr(text, "intermediate_size", 4 * hidden) or 4 * hidden)
    activations = max_num_batched_tokens * (4 * hidden + 3 * intermediate + captured_layers * hidden) * size \
        + max_num_seqs * vocab * 4
    fit = DeviceFit(parameters=parameters, weight_bytes=parameters * size, kv_bytes_per_token=kv_per_token,
                    kv_cache_bytes=kv_cache, activation_bytes=activations, dtype=dtype, device_memory=device_memory,
                    utilization=utilization, quantized=bool(getattr(hf_config, "quantization_config", None)))
    if device_memory is not None:
        budget = device_memory * utilization
        for t in (1, 2, 4, 8):
            if t <= MAX_TP and (not heads or heads % t == 0):
                kv_share = 1.0 if mla or not kv_heads else -(-kv_heads // t) / kv_heads  # >= one head a rank
                fit.per_rank_bytes[t] = fit.weight_bytes // t + int(kv_cache * kv_share) + activations
        fit.tensor_parallel_size = next((t for t, b in fit.per_rank_bytes.items() if b <= budget), None)
    return fit
