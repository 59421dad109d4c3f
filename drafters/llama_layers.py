"""The Llama-layer toolbox of the draft decoders (EAGLE-3, EAGLE, P-EAGLE, DFlash): transformers' Llama modules sized
like the target's own layers, taking sizes, not a family's config.

    llama_layer_config(target_dir, hidden_size, vocab_size, num_layers=, intermediate_size=)
                                the draft layers' LlamaConfig: heads, kv heads, head_dim, eps, positions and RoPE
                                read from the target's config; the width, vocabulary, depth and MLP width given
    with_draft_attention(layer_config)   the same config, its attention set to drafters.attention's: a TTTAttention
                                mask (training) goes through ranged attention, a boolean mask (decoding) through sdpa
    cache_kwarg(cache)          {name: cache} under the keyword the installed transformers' Llama layers take their
                                cache by ("cache" since 5.20, "past_key_values" before)
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


def llama_layer_config(target_dir: str, hidden_size: int, vocab_size: int, *, num_layers: int,
                       intermediate_size: int | None = None):
    """A LlamaConfig for `num_layers` draft layers of width `hidden_size` over a vocabulary of `vocab_size`, sized
    like the target's layers at `target_dir` (heads, kv heads, head_dim, eps, max positions, default RoPE theta);
    intermediate_size None = the target's MLP width (4 * hidden_size when it has none)."""
    from transformers import AutoConfig, LlamaConfig

    hf = AutoConfig.from_pretrained(target_dir).get_text_config()
    heads = int(hf.num_attention_heads)
    kw: dict[str, Any] = dict(
        hidden_size=hidden_size, num_attention_heads=heads,
        num_key_value_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf, "head_dim", None) or hidden_size // heads),
        intermediate_size=int(intermediate_size or getattr(hf, "intermediate_size", None) or 4 * hidden_size),
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", None) or getattr(hf, "layer_norm_epsilon", None) or 1e-6),
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", None) or 4096),
        vocab_size=vocab_size, num_hidden_layers=num_layers, hidden_act="silu", attention_bias=False,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=getattr(hf, "eos_token_id", None),
        pad_token_id=getattr(hf, "pad_token_id", None))
    rope = getattr(hf, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_type", "default") == "default" and "rope_theta" in rope:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(rope["rope_theta"])}
    return LlamaConfig(**kw)


def with_draft_attention(layer_config):
    """`layer_config` with its attention implementation set to drafters.attention.ATTN_IMPLEMENTATION (returned for
    chaining): training passes a TTTAttention (ranged attention, no [T, T] term), decoding boolean masks over the
    layers' own caches, which go to transformers' sdpa as they are."""
    from drafters.attention import ATTN_IMPLEMENTATION

    layer_config._attn_implementation = ATTN_IMPLEMENTATION
    return layer_config


@functools.cache
def _cache_keyword() -> str:
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

    names = [set(inspect.signature(m.forward).parameters) for m in (LlamaAttention, LlamaDecoderLayer)]
    for name in ("cache", "past_key_values", "past_key_value"):
        if all(name in n for n in names):
            return name
    raise RuntimeError("transformers' Llama layers take their KV cache by none of cache / past_key_values / "
                       "past_key_value; hsx supports the transformers versions pyproject.toml names")


def cache_kwarg(cache) -> dict[str, Any]:
    """{keyword: cache} for a Llama attention or decoder layer call. transformers renamed the keyword (5.20:
    past_key_values -> cache), and a layer given the other name takes it as an unknown kwarg and runs without the
    cache: the keys of earlier unrolled steps go missing and the mask no longer fits."""
    return {_cache_keyword(): cache}
