"""How a target's cache forgets rejected drafts (speculative decoding), by the kinds of layers it holds.

    rollback_plan(model) -> RollbackPlan        what the target's cache layers need; ValueError (one line) for a
                                                target whose cache hsx cannot roll back
    plan.new_cache()                            the cache a speculative engine decodes in
    plan.begin(cache, width)                    before a verify forward feeding every row `width` tokens
    plan.undo(cache, removed)                   after it: row b's recurrent / convolution states put back to where
                                                they were before its last removed[b] tokens

By layer kind (transformers' cache layers):
- full attention (DynamicLayer): rejected positions stay in the cache, masked out (BatchState.rollback); rows may
  advance by different numbers of tokens (holes between them are masked).
- sliding-window attention (DynamicSlidingWindowLayer): decoded in a full DynamicLayer instead, so no token leaves
  the window early, and the holes are squeezed out after every step (`compact`): the window is measured in cache
  columns, so a hole would push a real token out of it. Rows are fed evenly within a step (no hole inside one).
- linear attention (LinearAttentionLayer: gated DeltaNet in Qwen3-Next / Qwen3.5): the verify forward records every
  token's recurrent state and keeps the convolution window's full past (transformers' past recording); `undo` puts
  each row's state back to the one after its kept tokens. Rows are fed evenly: these layers see a padded hole as a
  token (the recurrent state would decay through it).
- anything else (layers that hold both kinds, SSM mixers that do not record their past): refused.

Whether the model's own code records its states is checked once (`probe`) on a short input, not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from extractor.facts import text_config

FULL, SLIDING, LINEAR = "DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionLayer"


@dataclass(frozen=True)
class RollbackPlan:
    config: object
    """The model's transformers config (its text decoder's layer kinds decide the plan)."""
    kinds: tuple[str, ...]
    """The cache layer class of each decoder layer, as transformers builds the cache for this config."""

    @property
    def even(self) -> bool:
        """Every row gets the same number of new tokens in a step (padded with throw-away drafts)."""
        return any(kind != FULL for kind in self.kinds)

    @property
    def compact(self) -> bool:
        """Holes are squeezed out of the cache after every step (sliding windows count columns)."""
        return SLIDING in self.kinds

    @property
    def recorded(self) -> bool:
        return LINEAR in self.kinds

    def new_cache(self):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.config)
        cache.layers = [DynamicLayer() if type(layer).__name__ == SLIDING else layer for layer in cache.layers]
        return cache

    def begin(self, cache, width: int) -> None:
        for layer in _linear_layers(cache):
            layer.activate_past_recording(recurrent_states_to_keep=width)
            # one history list per state (transformers' dict.fromkeys shares one list between them)
            layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}

    @torch.inference_mode()
    def undo(self, cache, width: int, removed: list[int]) -> None:
        """After a forward of `width` tokens per row begun with `begin`: row b's linear-layer states as they were
        after its first width - removed[b] tokens; recording stops."""
        for layer in _linear_layers(cache):
            for i in range(layer.number_of_states):
                if layer.is_conv_states_initialized[i]:
                    conv = layer.conv_states[i]  # [B, C, K + width]: the window before the step, then each token
                    k, end = layer.conv_kernel_size[i], conv.shape[-1]
                    if end != k + width:
                        raise RuntimeError(f"a linear-attention layer kept {end - k} convolution steps for a forward "
                                           f"of {width} tokens (internal error: speculative decoding would be wrong)")
                    layer.conv_states[i] = torch.stack([conv[b, :, end - n - k:end - n]
                                                        for b, n in enumerate(removed)]).contiguous()
                if layer.is_recurrent_states_initialized[i]:
                    history = layer.recurrent_states_history[i]  # the state before each of the width tokens
                    if len(history) != width:
                        raise RuntimeError(f"a linear-attention layer recorded {len(history)} recurrent states for a "
                                           f"forward of {width} tokens (internal error: speculative decoding would "
                                           "be wrong)")
                    current = layer.recurrent_states[i]  # [B, ...] after all width tokens
                    kept = torch.stack([current[b] if n == 0 else history[width - n][b]
                                        for b, n in enumerate(removed)])
                    current.copy_(kept)
                    layer.recurrent_states_history[i] = []
            layer.record_past = False

    @torch.inference_mode()
    def probe(self, model, cache_kw: str) -> None:
        """ValueError unless the model's linear layers record their past as `undo` needs (a 3-token prompt, then a
        recorded 2-token step undone by one token, against feeding the kept token alone)."""
        if not self.recorded:
            return
        missing = _recording_missing()
        if missing:
            raise ValueError(self._refusal(missing))
        device = model.get_input_embeddings().weight.device
        vocab = int(model.get_input_embeddings().num_embeddings)
        ids = (torch.arange(5, device=device)[None] * 7919 + 11) % vocab  # [1, 5]
        try:  # the reference decodes tokens 3 and 4 one at a time: the recurrent kernel, as the recorded step uses
            reference = self.new_cache()
            model(input_ids=ids[:, :3], use_cache=True, **{cache_kw: reference})
            model(input_ids=ids[:, 3:4], use_cache=True, **{cache_kw: reference})
            want = model(input_ids=ids[:, 4:], use_cache=True, **{cache_kw: reference}).logits[:, -1]
            cache = self.new_cache()
            model(input_ids=ids[:, :3], use_cache=True, **{cache_kw: cache})
            self.begin(cache, 2)
            model(input_ids=ids[:, 3:5], use_cache=True, **{cache_kw: cache})  # token 4 is rejected ...
            self.undo(cache, 2, [1])
            for layer in cache.layers:  # ... and its full-attention column dropped (the engine masks it instead)
                if type(layer).__name__ == FULL:
                    layer.crop(-1)
                else:
                    layer.cumulative_length_linear.sub_(1)
            got = model(input_ids=ids[:, 4:], use_cache=True, **{cache_kw: cache}).logits[:, -1]
        except (RuntimeError, AttributeError, TypeError, KeyError, IndexError) as e:
            raise ValueError(self._refusal(f"its linear layers cannot be rolled back ({type(e).__name__}: {e})")
                             ) from None
        tol = 1e-4 if got.dtype == torch.float32 else 5e-2  # bf16 / fp16: the attention of 2 tokens vs 1 rounds apart
        if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
            raise ValueError(self._refusal("its linear layers' recorded states do not roll back to plain decoding's"))

    def _refusal(self, why: str) -> str:
        return (f"speculative decoding on {getattr(self.config, 'model_type', 'this model')}: {why}, so rejected "
                "drafts could not be undone; decode without speculative_config")


ROLLBACK_TRANSFORMERS = "5.25"
"""The first transformers whose linear-attention cache records each step's recurrent states
(activate_past_recording(recurrent_states_to_keep=...)): 5.19-5.24 record none."""


def _recording_missing() -> str | None:
    """Why this transformers cannot record linear layers' per-step states (its version named), or None."""
    import inspect

    import transformers
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    recording = inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters
    if "recurrent_states_to_keep" in recording:
        return None
    return (f"its linear layers are rolled back with transformers >= {ROLLBACK_TRANSFORMERS}, whose cache records "
            f"each step's recurrent states; this is transformers {transformers.__version__}: pip install "
            f"'transformers>={ROLLBACK_TRANSFORMERS}'")


def rollback_plan(model, max_model_len: int) -> RollbackPlan:
    """The plan for a loaded transformers model decoding up to `max_model_len` tokens; ValueError (one line) for a
    cache hsx cannot roll back."""
    config = model.config
    text = text_config(config)
    layer_types = list(getattr(text, "layer_types", None) or [])
    chunk = getattr(text, "attention_chunk_size", None)
    if "chunked_attention" in layer_types and chunk and chunk < max_model_len:
        raise ValueError(RollbackPlan(config, ())._refusal(
            f"its chunked-attention layers (chunks of {chunk} tokens, fixed to absolute positions) are not rolled "
            f"back by hsx; use max_model_len <= {chunk}"))
    # a window (or chunk) longer than any request still needs the compaction: its mask counts cache columns, and the
    # holes rejected drafts leave would push real tokens out of it
    kinds = cache_kinds(config)
    plan = RollbackPlan(config, kinds)
    other = sorted({kind for kind in kinds if kind not in (FULL, SLIDING, LINEAR)})
    if other:
        raise ValueError(plan._refusal(f"its cache holds {', '.join(other)} layers (layers "
                                       f"{[i for i, k in enumerate(kinds) if k in other]}), which hsx cannot roll back"))
    if plan.recorded and plan.compact:
        raise ValueError(plan._refusal("its cache mixes sliding-window and linear-attention layers, which hsx does not "
                                       "roll back together"))
    return plan


def refuse_state_space_only(model) -> None:
    """ValueError (one line) for a model without attention layers (Mamba): hsx's engine feeds chunked prefill and
    padded batches through an attention mask over the whole cache, which such models read per chunk."""
    if set(cache_kinds(model.config)) == {LINEAR}:
        raise ValueError(f"{getattr(model.config, 'model_type', type(model).__name__)} has no attention layers (a pure "
                         "state-space model): hsx's engine runs attention and hybrid decoders only; use --engine vllm")


def cache_kinds(config) -> tuple[str, ...]:
    """The cache layer class of each decoder layer, as transformers builds the cache for `config`."""
    from transformers import DynamicCache

    return tuple(type(layer).__name__ for layer in DynamicCache(config=config).layers)


def _linear_layers(cache) -> list:
    return [layer for layer in cache.layers if type(layer).__name__ == LINEAR]
