"""The model runner: load a HF causal LM once, run prefill (chunked) and decode steps with layer capture.

    ModelRunner(config)
    prefill(rows, chunk_size, want_logits, keep_cache, on_chunk) -> (logits [B, V] | None, BatchState)
    decode(state, tokens, capture) -> (logits [B, V], Captured [B, 1, ...] | None)
    extend(state, rows, capture) -> (logits [B, W, V], states [B, W, L, H] | None)   several new tokens per row
    set_capture(layer_ids, top_k=)               the layers captured from now on (none: prefill hands on no states);
                                                 top_k: the last of them becomes a top-k target (extractor.topk)

Rows that will generate are left-padded so every row's last token sits in the last column: logits are computed for
that column only (`logits_to_keep=1`); position ids come from the attention mask, so padding never shifts a row's
positions. Prompt-only rows are right-padded and run with no attention mask at all: causal attention never looks
ahead, so the padding after a row cannot reach its tokens, and attention takes its causal fast path (SDPA's
`is_causal`, no [B, 1, S, S] mask) instead of a masked one. With nothing to sample the lm_head is skipped and the
forward stops after the deepest requested layer.

The batch's cache and its rows' column masks (BatchState, Captured, forward_rows) are extractor/batch_state.py's.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable

import torch

from connectors.format import HIDDEN_STATES_SCALES, TARGET_TOPK_IDS, TARGET_TOPK_LOGPROBS, check_layer_ids
from connectors.quant import ROW_MAGNITUDES, quantize, row_magnitudes
from extractor.batch_state import BatchState, Captured, forward_rows
from extractor.config import EngineConfig
from extractor.facts import check_runnable, target_facts
from extractor.layers import EarlyExit, LayerCapture, find_decoder_layers
from extractor.multimodal import MediaPrompt, Vision, check_supported, is_multimodal, load_processor
from extractor.packing import Packer, packing_refusal
from extractor.rollback import RollbackPlan, refuse_state_space_only, rollback_plan
from extractor.topk import TopK

logger = logging.getLogger(__name__)


def resolve_device(device: str | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu' or leave it unset")
    return dev


def _load_model(auto_cls, model: str, hf_config, kwargs: dict):
    """from_pretrained, as transformers loads the checkpoint. A quantized one (a quantization_config: fp8, MXFP4, ...)
    gets one line saying what transformers did — kept its quantized weights, or dequantized them where its kernels
    are missing (transformers' own warning says why) — and a load transformers refuses is one line naming the
    quantization."""
    from connectors.fingerprint import model_quantization

    quant = model_quantization(hf_config)
    if not quant:
        return auto_cls.from_pretrained(model, **kwargs)
    try:
        loaded = auto_cls.from_pretrained(model, **kwargs)
    except (ImportError, RuntimeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{model} is a quantized checkpoint ({quant}) and transformers cannot load it here: "
                         f"{first}") from e
    # GPTQ / AWQ / compressed-tensors keep their packed integer weights as buffers, fp8 as parameters
    kept = sorted({str(t.dtype).removeprefix("torch.") for _, t in (*loaded.named_parameters(), *loaded.named_buffers())
                   if (t.dtype.itemsize <= 1 and t.dtype != torch.bool) or t.dtype == torch.int32})
    logger.warning("%s is a quantized checkpoint (%s): transformers %s", model, quant,
                   f"kept its quantized weights ({', '.join(kept)})" if kept else
                   f"dequantized it to {str(next(loaded.parameters()).dtype).removeprefix('torch.')}")
    return loaded


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.device = resolve_device(config.device)
        hf_config = AutoConfig.from_pretrained(config.model, revision=config.revision,
                                               trust_remote_code=config.trust_remote_code)
        check_runnable(hf_config, config.model)
        self.facts = target_facts(hf_config, model=config.model, revision=config.revision,
                                  layer_ids=config.layer_ids, dtype=config.dtype, max_model_len=config.max_model_len,
                                  target=config.target)
        dtype = getattr(torch, self.facts.dtype)
        if self.device.type == "cpu" and dtype == torch.float16:
            logger.warning("float16 on CPU is slow and lossy; consider dtype='bfloat16' or 'float32'")
        kwargs = {"dtype": dtype, "revision": config.revision, "trust_remote_code": config.trust_remote_code}
        if config.attn_implementation:
            kwargs["attn_implementation"] = config.attn_implementation
        multimodal = is_multimodal(hf_config)
        if multimodal:
            from transformers import AutoModelForImageTextToText as auto_cls

            check_supported(hf_config, config.model)
        else:
            auto_cls = AutoModelForCausalLM
        self.model = _load_model(auto_cls, config.model, hf_config, kwargs).to(self.device).eval()
        self.model.requires_grad_(False)
        refuse_state_space_only(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model, revision=config.revision,
                                                       trust_remote_code=config.trust_remote_code)
        self.hf_config = self.model.config
        self.vision: Vision | None = None
        """A vision-language target's processor and vision path (extractor.multimodal); None for text targets."""
        if multimodal:
            processor = load_processor(config.model, revision=config.revision,
                                       trust_remote_code=config.trust_remote_code,
                                       tokenizer=self.tokenizer if config.tokenizer else None)  # LLM(tokenizer=)'s
            self.vision = Vision(self.model, processor, hf_config)
        self.dtype = dtype
        self.num_hidden_layers, self.hidden_size = self.facts.num_hidden_layers, self.facts.hidden_size
        self.layer_ids = self.facts.layer_ids
        self.capture: LayerCapture | None = None
        self.device_storage: str | None = None
        """A scaled storage dtype (fp8) the captured rows are converted to on the device before they go to the host
        (LLM sets it for an fp8 connector on CUDA): the connector gets them with their scales and magnitudes."""
        self._top_k: TopK | None = None
        self.rollback: RollbackPlan | None = None
        self.set_capture(self.facts.capture_layer_ids, top_k=self.facts.top_k)
        self.base = self.model.base_model
        self.max_model_len = self.facts.max_model_len
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self.packer: Packer | None = None
        """Packed prefill of prompt-only batches (extractor.packing); None: they are padded."""
        self.packing_refusal = self._set_up_packing(config.packing)
        """Why prompt-only batches are padded rather than packed (None: they are packed)."""

    def _set_up_packing(self, mode: str) -> str | None:
        """Packing where it is exact (the checks and the probe of extractor.packing); the reason it is not, else. With
        mode "on" a target that cannot be packed is refused (ValueError, one line)."""
        if mode == "off":
            return "packing is off"
        text = self.hf_config.get_text_config()
        inner = getattr(text, "_attn_implementation", None)
        why = packing_refusal(self.model, inner)
        packer, probed = None, False
        if why is None:
            probed = True
            packer = Packer(self.model, self.base, inner)
            window = getattr(text, "sliding_window", None)
            if self.capture is not None:
                self.capture.enabled = False
            try:
                why = packer.probe(self.pad, self.device, self.vocab_size, self.dtype,
                                   window if isinstance(window, int) else None)
            except Exception as e:  # a model that cannot run a packed row at all: padded batches
                why = f"a packed probe forward failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            finally:
                if self.capture is not None:
                    self.capture.enabled = True
        if why is None:
            self.packer = packer
            return None
        if mode == "on":
            raise ValueError(f"packing='on' but {getattr(text, 'model_type', 'this target')} cannot pack prompts: {why}; "
                             "use packing='auto' (padded batches where packing does not apply) or 'off'")
        (logger.warning if probed else logger.info)("prompt-only batches are padded, not packed: %s", why)
        return why

    def set_capture(self, layer_ids: tuple[int, ...], top_k: int | None = None) -> None:
        """Capture these layer ids from now on (empty: capture nothing; prefill hands on_chunk None). With `top_k`,
        the last id (N) is not handed on: its top-K next-token log-probabilities are, in its place."""
        if self.capture is not None:
            self.capture.close()
        self.capture = None
        self._top_k = None
        if layer_ids:
            ids = check_layer_ids(layer_ids, self.num_hidden_layers)
            if top_k is not None:
                assert ids[-1] == self.num_hidden_layers, ids  # TargetFacts.capture_layer_ids puts N last
                self._top_k = TopK.of_model(self.model, top_k)
            self.capture = LayerCapture(find_decoder_layers(self.model, self.num_hidden_layers), ids)

    def _captured(self, states: torch.Tensor, to_host: bool, packed: bool = False) -> Captured:
        """Collected states [B, S, L(+1), H] as the connector takes them: a top-k target split off the last layer
        (on the model's device), then on the CPU unless `to_host` is off."""
        extra: dict[str, torch.Tensor] = {}
        if self._top_k is not None:
            ids, logprobs = self._top_k(states[:, :, -1])  # [B, S, K] each
            states = states[:, :, :-1]
            extra = {TARGET_TOPK_IDS: ids, TARGET_TOPK_LOGPROBS: logprobs}
        if self.device_storage is not None:  # fp8 cast and scales here, before the copy: half the bytes cross
            rows = states.flatten(0, 1)  # [B * S, L, H]: converted in blocks of tokens, whatever B (a packed row: 1)
            magnitudes = row_magnitudes(rows)  # the connector's state check reads them
            stored, scales = quantize(rows, self.device_storage, magnitudes)
            shape = states.shape
            states = stored.view(shape)
            extra.update({HIDDEN_STATES_SCALES: scales.view(*shape[:3], 1),
                          ROW_MAGNITUDES: magnitudes.view(*shape[:3])})
        if to_host:
            states = self.to_host(states)
            extra = {name: self.to_host(t) for name, t in extra.items()}
        return Captured(states, extra, packed)

    def close(self) -> None:
        if self.capture is not None:
            self.capture.close()
            self.capture = None

    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.hf_config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if eos is None:
                continue
            ids.update(eos if isinstance(eos, (list, tuple, set)) else [eos])
        return ids

    def prepare_speculation(self) -> RollbackPlan:
        """From now on decode in caches that can forget rejected drafts (extractor.rollback); ValueError (one line)
        for a target whose cache hsx cannot roll back."""
        plan = rollback_plan(self.model, self.max_model_len)
        plan.probe(self.model, self._cache_kw)
        self.rollback = plan
        return plan

    def _new_cache(self):
        from transformers import DynamicCache

        return self.rollback.new_cache() if self.rollback is not None else DynamicCache(config=self.hf_config)

    def _logits(self, **inputs) -> torch.Tensor:
        """Forward the full LM and return last-position logits [B, V]."""
        if self._has_logits_to_keep:
            return self.model(**inputs, logits_to_keep=1).logits[:, -1]
        out = self.base(**inputs)
        return self.model.get_output_embeddings()(out.last_hidden_state[:, -1])

    def pad(self, rows: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                               list[int]]:
        """Padded batch on the device: ids [B, W], attention mask [B, W] (None when right-padded), positions [B, W],
        and the first column of each row."""
        width = max(len(r) for r in rows)
        starts = [width - len(r) if left else 0 for r in rows]
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, starts[b]:starts[b] + len(r)] = torch.tensor(r, dtype=torch.long)
        if not left:  # causal attention: the padding after a row never reaches it, so no mask is needed
            positions = torch.arange(width, dtype=torch.long).expand(len(rows), width)
            return ids.to(self.device), None, positions.to(self.device), starts
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, start in enumerate(starts):
            mask[b, start:] = 1
        mask = mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return ids.to(self.device), mask, positions, starts

    def to_host(self, states: torch.Tensor) -> torch.Tensor:
        """Copy captured states to CPU; from CUDA through pinned memory (a DMA copy, no pageable staging)."""
        if states.device.type == "cpu":
            return states
        states = states.contiguous()  # a view (the stored layers beside a top-k target) copies as its own shape
        host = torch.empty(states.shape, dtype=states.dtype, pin_memory=states.device.type == "cuda")
        host.copy_(states, non_blocking=host.is_pinned())
        if host.is_pinned():
            torch.cuda.current_stream(states.device).synchronize()  # the copy is done before anyone reads `host`
        return host

    def _media_inputs(self, ids: torch.Tensor, positions: torch.Tensor, starts: list[int],
                      media: list[MediaPrompt | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A batch with image prompts as the language model takes it: merged input embeddings [B, W, H] (the vision
        tower's output at image positions), M-RoPE positions [3, B, W] (text rows and padding: their 1-D positions in
        every stream) and where each row continues decoding [B]."""
        embeds = self.model.get_input_embeddings()(ids)  # every row's tokens, image placeholders included
        streams = positions[None].expand(3, -1, -1).clone()
        following = positions[:, -1] + 1
        for b, m in enumerate(media):
            if m is None:
                continue
            n = len(m.input_ids)
            self.vision.merge(embeds[b], m, starts[b])  # the placeholders' rows replaced by the tower's output
            streams[:, b, starts[b]:starts[b] + n] = m.positions.to(self.device)
            following[b] = m.next_position
        return embeds, streams, following

    def _deepstack_forward(self, inputs: dict, chunk, want_logits: bool) -> torch.Tensor | None:
        """One prefill chunk of a deepstack target (Qwen3-VL) through its language model, the chunk's visual features
        added to the early layers' outputs at its image tokens; last-position logits [B, V] when wanted."""
        language = self.model.model.language_model
        extra = {} if chunk is None else {"visual_pos_masks": chunk[0], "deepstack_visual_embeds": chunk[1]}
        out = language(**inputs, **extra)
        if not want_logits:
            return None
        return self.model.get_output_embeddings()(out.last_hidden_state[:, -1])

    @torch.inference_mode()
    def prefill(self, rows: list[list[int]], chunk_size: int, want_logits: bool, keep_cache: bool,
                on_chunk: Callable[[int, int, Captured | None, list[int]], None], to_host: bool = True,
                capture: bool = True, media: list[MediaPrompt | None] | None = None, packed: bool = False
                ) -> tuple[torch.Tensor | None, BatchState | None]:
        """Run rows (token id lists) through the model, handing captured states of each chunk to `on_chunk`.

        on_chunk(col_start, col_end, captured, starts) gets Captured rows [B, col_end - col_start, ...] (on the CPU,
        or on the device with to_host=False; None when nothing is captured) for padded columns [col_start, col_end)
        of the batch; row b holds its tokens in columns [starts[b], starts[b] + len(rows[b])).
        Rows are left-padded when logits or the cache are wanted (decoding follows), right-padded otherwise.
        `capture` off: nothing is captured (no row of the batch writes a file), on_chunk gets None.
        `media`: per row, an image prompt's processed inputs (a vision-language target; rows[b] is then its
        input_ids) or None; a batch with any runs on merged input embeddings and M-RoPE positions.
        `packed` (prompt-only text rows, the runner's packer set, the rows within one forward's budget): the rows end
        to end in one row, no padding (extractor.packing); on_chunk then gets one call with a packed Captured and each
        row's first column in it.
        """
        if packed:
            if self.packer is None or want_logits or keep_cache or (media is not None and any(media)):
                raise RuntimeError("a packed prefill needs prompt-only text rows and a packing runner (internal error)")
            ids, positions, starts = self.packer.inputs(rows, self.device)
            mask, width = None, ids.shape[1]
            chunk_size = width
        else:
            width = max(len(r) for r in rows)
            ids, mask, positions, starts = self.pad(rows, left=want_logits or keep_cache)
        embeds, following, deep = None, positions[:, -1] + 1, None
        if media is not None and any(m is not None for m in media):
            if self.vision is None:
                raise ValueError("image inputs for a text-only target (internal error: the request should have been "
                                 "refused)")
            embeds, positions, following = self._media_inputs(ids, positions, starts, media)
            deep = self.vision.deepstack_batch(media, starts, width, self.device)  # Qwen3-VL's, or None
        cache = self._new_cache() if (keep_cache or chunk_size < width) else None
        capture = self.capture if capture else None
        early_exit = not want_logits and not keep_cache and capture is not None
        logits = None
        if self.capture is not None:
            self.capture.enabled = capture is not None  # hooks silent while nothing is captured
        try:
            for c0 in range(0, width, chunk_size):
                c1 = min(width, c0 + chunk_size)
                inputs = {"attention_mask": None if mask is None else mask[:, :c1],
                          "position_ids": positions[..., c0:c1], "use_cache": cache is not None}
                if embeds is None:
                    inputs["input_ids"] = ids[:, c0:c1]
                else:
                    inputs["inputs_embeds"] = embeds[:, c0:c1]
                if cache is not None:
                    inputs[self._cache_kw] = cache
                if capture is not None:
                    capture.begin(early_exit=early_exit)
                chunk = None if deep is None else deep.chunk(c0, c1)
                try:
                    with (self.packer.active(starts, [len(r) for r in rows]) if packed
                          else contextlib.nullcontext()):
                        if deep is not None:  # deepstack: the language model itself, with this chunk's visual features
                            logits = self._deepstack_forward(inputs, chunk, want_logits and c1 == width)
                        elif want_logits and c1 == width:
                            logits = self._logits(**inputs)
                        else:
                            self.base(**inputs)
                except EarlyExit:
                    pass
                finally:
                    if capture is not None:
                        capture.end()
                captured = None
                if capture is not None:
                    states = capture.collect()
                    if deep is not None:  # stored after each layer's deepstack add, as vLLM hands its proposer
                        deep.add_to(states, capture.layer_ids, chunk)
                    captured = self._captured(states, to_host, packed)
                on_chunk(c0, c1, captured, starts)
        finally:
            if self.capture is not None:
                self.capture.enabled = True
        state = BatchState(cache, mask, following) if keep_cache else None
        return logits, state

    @torch.inference_mode()
    def decode(self, state: BatchState, tokens: list[int], capture: bool, to_host: bool = True
               ) -> tuple[torch.Tensor, Captured | None]:
        """One step: feed each active row its newest token; return logits [B, V] and, with `capture`, the captured
        rows [B, 1, ...] (on the CPU, or on the device with to_host=False)."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        state.attention_mask = torch.cat([state.attention_mask, torch.ones_like(state.attention_mask[:, :1])], dim=1)
        inputs = {"input_ids": ids, "attention_mask": state.attention_mask,
                  "position_ids": state.next_position[:, None], "use_cache": True, self._cache_kw: state.cache}
        with self._capturing(capture):
            logits = self._logits(**inputs)
            states = self._captured(self.capture.collect(), to_host=to_host) if capture else None
        state.next_position = state.next_position + 1
        return logits, states

    @torch.inference_mode()
    def extend(self, state: BatchState, rows: list[list[int]], capture: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed each active row its new tokens (its last accepted token + drafts): logits [B, W, V] and, with
        `capture`, the captured states [B, W, L, H] on the device; row b's tokens sit in its last len(rows[b])
        columns."""
        with self._capturing(capture):
            logits = forward_rows(self.model, state, rows, self.pad_id, self._cache_kw)
            return logits, (self.capture.collect() if capture else None)

    @contextlib.contextmanager
    def _capturing(self, capture: bool):
        """Hooks armed for one forward when `capture`, silent otherwise."""
        if capture and self.capture is None:
            raise RuntimeError("capture requested but the runner captures no layers (internal error)")
        if self.capture is None:
            yield
            return
        self.capture.enabled = capture
        self.capture.begin(early_exit=False)
        try:
            yield
        finally:
            self.capture.end()
            self.capture.enabled = True
