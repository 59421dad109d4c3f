"""Vision-language targets: image prompts into hsx's engine the way vLLM takes them, processed by the model's own
transformers processor, and the record that makes their states usable for a drafter.

    is_multimodal(hf_config) -> bool                 a vision-language family hsx runs with its vision tower
    check_supported(hf_config, model)                ValueError (one line) for a VL family hsx cannot run exactly
    load_processor(model, revision=, trust_remote_code=, tokenizer=)
                                                     AutoProcessor; where torchvision is missing (CPU machines), the
                                                     same processor class built without its video processor
    MediaPrompt                                      one request's processed inputs: ids with every placeholder
                                                     expanded, the vision tower's features, modality mask, positions
    Vision(model, processor, hf_config)              prepare(text, images) -> MediaPrompt (the vision tower runs
                                                     here, once); merge(row_embeds, prompt, start): the tower's
                                                     output at its image tokens (the merged input embeddings)

What a prompt may bring and how its images are loaded (vLLM's limit_mm_per_prompt, allowed_local_media_path):
extractor.media.

Deepstack (Qwen3-VL): the vision tower's intermediate features are added to the first few decoder layers' outputs at
image tokens; prefill then runs the language model itself with each chunk's share of them (DeepstackBatch), and the
stored id k is layer k-1's output after its add, as vLLM records it for its proposer.

Positions. Qwen2-VL / Qwen2.5-VL / Qwen3-VL rotate with M-RoPE: three position streams (time, height, width), which differ from
0..T-1 inside and after an image. `MediaPrompt.positions` is the model's own `get_rope_index` of the processed
inputs ([3, T]); decoding continues every stream at `next_position` = max + 1 (transformers' `rope_deltas` rule).
Text-only prompts on such a target have positions 0..T-1 in all three streams and run as text.

What a file of a multimodal request holds beside the states (connectors.format): `mm_token_type_ids` uint8 [T] (0
text, 1 image; the processor's own), `position_ids` int64 [T, 3] (the M-RoPE streams; output tokens continue them)
and, behind the connector's `store_mm_embeds`, `mm_embeds` [N, H]: the merged input embeddings at the N image
positions (what vLLM's EAGLE proposer feeds the drafter there, and what a trainer needs to reproduce it).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from extractor.media import DEEPSTACK_VL, SUPPORTED_VL, check_supported, is_multimodal  # noqa: F401

logger = logging.getLogger(__name__)

def load_processor(model: str, *, revision: str | None = None, trust_remote_code: bool = False, tokenizer=None):
    """The model's processor, with `tokenizer` (the engine's: LLM(tokenizer=...)) in place of the folder's when
    given. transformers' Qwen-VL processors require a video processor, which requires torchvision; where torchvision
    cannot be imported (CPU builds of torch have no matching wheel) the same processor class is built from the
    tokenizer and the folder's image processor with no video processor: images process identically, a video is
    refused."""
    from transformers import AutoProcessor

    kw = {"revision": revision, "trust_remote_code": trust_remote_code}
    try:
        processor = AutoProcessor.from_pretrained(model, **kw)
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise
        logger.info("torchvision is not importable here: %s's processor is built without its video processor", model)
        return _image_only_processor(model, kw, tokenizer)
    if tokenizer is None:
        return processor
    parts = {name: getattr(processor, name) for name in processor.get_attributes()}  # the same class, rebuilt
    return type(processor)(**{**parts, "tokenizer": tokenizer}, chat_template=getattr(processor, "chat_template", None))


def _image_only_processor(model: str, kw: dict, tokenizer=None):
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    kind = AutoConfig.from_pretrained(model, **kw).model_type
    cls = getattr(transformers, PROCESSOR_MAPPING_NAMES[kind])

    class ImageOnly(cls):  # the class's own processing; only its check that a video processor exists is skipped
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and "video" in argument_name:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model, **kw)
    image_processor = AutoImageProcessor.from_pretrained(model, **kw)
    return ImageOnly(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                     chat_template=getattr(tokenizer, "chat_template", None))


@dataclass
class DeepstackBatch:
    """A batch's deepstack inputs: mask [B, W] of its image tokens, per deepstack layer [N, H] in row-major order.

    hsx stores layer id k (the output of decoder layer k-1) after that layer's deepstack add, as vLLM (0.32)
    captures the aux states it hands its proposer (`hidden_states + deepstack` before it records layer k);
    transformers' own hidden_states (5.25) are the layer's output before the add."""

    mask: torch.Tensor
    features: list[torch.Tensor]

    def chunk(self, c0: int, c1: int) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The chunk [c0, c1)'s mask and features, or None when it holds no image token."""
        part = self.mask[:, c0:c1]
        if not bool(part.any()):
            return None
        cols = torch.nonzero(self.mask)[:, 1]  # row-major, as the features are
        keep = (cols >= c0) & (cols < c1)
        return part, [f[keep] for f in self.features]

    def add_to(self, states: torch.Tensor, layer_ids, chunk: tuple[torch.Tensor, list[torch.Tensor]] | None) -> None:
        """Captured states [B, c, L, H] of a chunk, in place: id k (1 <= k <= layers) + deepstack layer k-1 at the
        chunk's image tokens."""
        if chunk is None:
            return
        part, features = chunk
        for j, k in enumerate(layer_ids):
            if 1 <= k <= len(features):
                view = states[:, :, j]
                view[part] = view[part] + features[k - 1].to(view.dtype)


PIXEL_LIMIT_KEYS = ("min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size")


def pixel_limits(image_processor) -> dict[str, int]:
    """An image processor's resizing bounds and patching (what every image it processes goes through)."""
    out = {}
    for key in PIXEL_LIMIT_KEYS:
        value = getattr(image_processor, key, None)
        if value is None and key.endswith("_pixels"):  # transformers 5 keeps them in `size` as well
            size = getattr(image_processor, "size", None) or {}
            value = size.get({"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}[key])
        if isinstance(value, int):
            out[key] = value
    return out


def image_processing(model: str, *, revision: str | None = None, trust_remote_code: bool = False) -> dict[str, int]:
    """The pixel limits of a vision-language target's image processor, read from its folder (no weights)."""
    from transformers import AutoImageProcessor

    return pixel_limits(AutoImageProcessor.from_pretrained(model, revision=revision,
                                                           trust_remote_code=trust_remote_code))


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of True in a 1-D bool tensor."""
    runs, start = [], None
    for i, v in enumerate(mask.tolist() + [False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


# -- processing -------------------------------------------------------------------------------------------------------
@dataclass
class MediaPrompt:
    """One request's processed multimodal inputs (on the CPU)."""

    input_ids: list[int]  # placeholders expanded to the processor's count
    image_features: torch.Tensor  # [N, H] model dtype: the vision tower's output, one row per image token, in order
    image_grid_thw: torch.Tensor  # [images, 3]
    mm_token_type_ids: torch.Tensor  # uint8 [T]: 0 text, 1 image
    positions: torch.Tensor  # int64 [3, T]
    next_position: int  # where decoding continues, in every stream
    tokens_per_image: tuple[int, ...] = ()  # each image's count of tokens in input_ids, in order
    deepstack: tuple[torch.Tensor, ...] = ()  # Qwen3-VL: per deepstack layer [N, H], added to that layer's output

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def expand(self, unexpanded_ids: list[int], values: list[int], image_token_id: int, fill: int = 0) -> list[int]:
        """Per-token `values` over the prompt as tokenized before the processor expanded it (one placeholder per
        image, `unexpanded_ids`) carried over to input_ids: each image's tokens get `fill` (a loss mask: 0)."""
        if len(values) != len(unexpanded_ids):
            raise ValueError(f"{len(values)} values for a prompt of {len(unexpanded_ids)} tokens")
        out: list[int] = []
        images = iter(self.tokens_per_image)
        for token, value in zip(unexpanded_ids, values):
            if token == image_token_id:
                count = next(images, None)
                if count is None:
                    raise ValueError("the prompt has more image placeholders than images")
                out.extend([fill] * count)
            else:
                out.append(value)
        if len(out) != len(self.input_ids) or next(images, None) is not None:
            raise ValueError(f"the prompt before expansion does not match the processed one ({len(out)} tokens "
                             f"expanded, {len(self.input_ids)} processed)")
        return out

    def truncated(self, limit: int) -> MediaPrompt:
        """The first `limit` tokens, when no image is cut: ValueError naming the image whose tokens reach past the
        limit (an image block is never stored half, nor an image fed without its tokens)."""
        if len(self.input_ids) <= limit:
            return self
        image_at = torch.nonzero(self.mm_token_type_ids).flatten().tolist()
        if image_at and image_at[-1] >= limit:
            ends = list(itertools.accumulate(self.tokens_per_image))
            k = next(i for i, end in enumerate(ends) if end > sum(1 for p in image_at if p < limit))
            raise ValueError(f"the sample has {len(self.input_ids)} tokens, more than the limit of {limit}, and "
                             f"cutting it there would cut image {k} (its tokens end at {image_at[ends[k] - 1] + 1}); "
                             "raise --max-model-len, lower --max-tokens, or use fewer or smaller images")
        positions = self.positions[:, :limit]
        return MediaPrompt(input_ids=self.input_ids[:limit], image_features=self.image_features,
                           image_grid_thw=self.image_grid_thw, mm_token_type_ids=self.mm_token_type_ids[:limit],
                           positions=positions, next_position=int(positions.max()) + 1,
                           tokens_per_image=self.tokens_per_image, deepstack=self.deepstack)


class Vision:
    """A VL target's processor and vision path (see the module docstring)."""

    def __init__(self, model, processor, hf_config) -> None:
        self.model, self.processor, self.hf_config = model, processor, hf_config
        self.image_token_id = int(hf_config.image_token_id)
        self.inner = model.model  # Qwen2_5_VLModel: get_image_features, get_rope_index
        self.deepstack = len(getattr(getattr(hf_config, "vision_config", None), "deepstack_visual_indexes", None)
                             or ())
        """Qwen3-VL: how many early decoder layers get visual features added to their outputs (0: none)."""
        self.pixel_limits = pixel_limits(processor.image_processor)
        """The image processor's resizing bounds, recorded in run.json (what every stored image went through)."""

    @torch.inference_mode()
    def prepare(self, text: str, images: list, where: str, max_tokens: int | None = None) -> MediaPrompt:
        """Process `text` (one image placeholder per image, as vLLM prompts carry them) with `images`: the expanded
        ids, the modality mask, the M-RoPE positions and the vision tower's features (computed once, here). A prompt
        longer than `max_tokens` once expanded is refused before the vision tower runs; each image's tokens must
        form a block of their own (a placeholder next to another without a token between is refused)."""
        image_token = getattr(self.processor, "image_token", "<|image_pad|>")
        found = text.count(image_token)
        if found != len(images):
            raise ValueError(f"{where}: the prompt has {found} image placeholder(s) {image_token!r} for {len(images)} "
                             f"image(s); put one placeholder where each image goes (a chat message's image part "
                             "adds it)")
        try:
            out = self.processor(text=[text], images=images or None, return_tensors="pt",
                                 return_mm_token_type_ids=True)
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"{where}: the processor refused the image(s): {str(e).splitlines()[0][:160]}") from None
        ids, types = out["input_ids"][0], out["mm_token_type_ids"][0]
        grid = out.get("image_grid_thw")
        grid = torch.zeros((0, 3), dtype=torch.long) if grid is None else grid
        if max_tokens is not None and ids.shape[0] > max_tokens:
            raise ValueError(f"{where}: with its images the prompt has {ids.shape[0]} tokens, more than the limit of "
                             f"{max_tokens}; use fewer or smaller images, or a shorter prompt")
        merge = int(self.pixel_limits.get("merge_size", 1)) ** 2
        per_image = tuple(int(g.prod()) // merge for g in grid)
        runs = _runs(types != 0)
        if [n for _, n in runs] != list(per_image):
            raise ValueError(f"{where}: the image placeholders are not separated ({len(runs)} image blocks for "
                             f"{len(per_image)} images); put text or the vision markers between images")
        embed = self.inner.get_input_embeddings()
        device = embed.weight.device
        features = torch.empty((0, embed.embedding_dim), dtype=embed.weight.dtype)
        deepstack: tuple[torch.Tensor, ...] = ()
        if len(grid):
            pixels = out["pixel_values"].to(device, self.inner.visual.dtype)
            encoded = self.inner.get_image_features(pixels, grid.to(device), return_dict=True)
            features = torch.cat(list(encoded.pooler_output), dim=0).to("cpu", embed.weight.dtype)
            deepstack = tuple(  # per deepstack layer: its per-image features, one [N, H] in token order
                (torch.cat(list(d)) if isinstance(d, (list, tuple)) else d).to("cpu", embed.weight.dtype)
                for d in getattr(encoded, "deepstack_features", None) or ())
        if int((ids == self.image_token_id).sum()) != features.shape[0]:
            raise ValueError(f"{where}: the processed prompt has {int((ids == self.image_token_id).sum())} image "
                             f"tokens for {features.shape[0]} image features")
        positions, _ = self.inner.get_rope_index(ids[None].to(device), mm_token_type_ids=types[None].to(device),
                                                 image_grid_thw=grid.to(device) if len(grid) else None,
                                                 attention_mask=None)
        positions = positions[:, 0].to("cpu", torch.long)  # [3, T]
        return MediaPrompt(input_ids=ids.tolist(), image_features=features, image_grid_thw=grid,
                           mm_token_type_ids=types.to(torch.uint8), positions=positions,
                           next_position=int(positions.max()) + 1 if positions.numel() else 0,
                           tokens_per_image=per_image, deepstack=deepstack)

    def deepstack_batch(self, media: list, starts: list[int], width: int, device: torch.device
                        ) -> DeepstackBatch | None:
        """A batch's deepstack inputs (Qwen3-VL): where its image tokens are and each deepstack layer's features in
        that (row-major) order; None when no row has any."""
        if not self.deepstack or not any(m is not None and m.deepstack for m in media):
            return None
        mask = torch.zeros((len(media), width), dtype=torch.bool)
        layers: list[list[torch.Tensor]] = [[] for _ in range(self.deepstack)]
        for b, m in enumerate(media):
            if m is None or not m.deepstack:
                continue
            at = torch.nonzero(m.mm_token_type_ids).flatten() + starts[b]
            mask[b, at] = True
            for j, d in enumerate(m.deepstack):
                layers[j].append(d)
        return DeepstackBatch(mask.to(device), [torch.cat(d).to(device) for d in layers])

    @staticmethod
    def merge(embeds: torch.Tensor, prompt: MediaPrompt, start: int) -> None:
        """A row's token embeddings [W, H] (the prompt's ids embedded from column `start`), in place: the vision
        tower's output at its image tokens — the merged input embeddings the model's own forward builds from
        input_ids and pixel_values."""
        if prompt.image_features.shape[0]:
            at = torch.nonzero(prompt.mm_token_type_ids).flatten().to(embeds.device) + start
            embeds[at] = prompt.image_features.to(embeds.device, embeds.dtype)
