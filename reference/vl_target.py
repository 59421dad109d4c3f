"""A vision-language target whose acceptance on image prompts means something: a small Qwen2.5-VL (transformers'
classes, a tiny vision tower) trained here, on CPU, on pictures drawn on the spot with questions whose answers only
the picture gives.

    VLTargetConfig(...)                      sizes, training length, seed, cache root (typed, validated)
    build_vl_target(config) -> VLTarget      .path: the checkpoint folder with its processor files (extractor.LLM, hsx
                                             serve, transformers load it); .report: reference_vl_target.json (losses,
                                             held-out answer accuracy, timing)
    Scene.draw(rng) / scene.image()          one picture: one or two shapes (circle, square, triangle) in a colour at a
                                             place, or a digit in a colour, on white
    chat(scene, rng) -> (question, answer)   a question about it (describe / colour / count / digit) and its answer
    image_chats(n, seed, folder)             n pictures saved as PNG under folder + OpenAI chat records that point at
                                             them (image_url parts with the file's name): a corpus for `hsx run`
    vl_config(tokenizer, family=) / vl_tokenizer(tokenizer) / save_vl_target(model, tokenizer, dir)
                                             a Qwen2.5-VL / Qwen3-VL config, tokenizer and folder (with its image
                                             processor): what this target and reference.tiny_models' random ones are

Training and held-out scenes come from different seeds. The build caches by a digest of the config, this module's
BUILD_VERSION and the torch / transformers versions under CACHE_ROOT/<digest>/ (built under a temporary name, renamed
when complete); a second call returns the cached folder. Random-weight models (reference/tiny_models.build_tiny_vl_model)
measure machinery; this one answers from what it sees, so a drafter's acceptance on image prompts means something.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
import uuid
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

BUILD_VERSION = "2"
REPORT_NAME = "reference_vl_target.json"
IMAGE_SIZE = 84
"""Pictures are 84 x 84: 6 x 6 patches of 14, merged 2 x 2 into 9 image tokens."""
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20),
           "purple": (140, 50, 170), "orange": (240, 130, 20)}
PLACES = {"left": (0.25, 0.5), "right": (0.75, 0.5), "top": (0.5, 0.25), "bottom": (0.5, 0.75),
          "middle": (0.5, 0.5)}
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url', 'image_pil', 'input_image') %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The tiny vision-language target's chat template: Qwen-VL's placeholder where each image part stands."""
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
VL_IMAGE_PIXELS = (28 * 28 * 4, 28 * 28 * 64)
"""The tiny target's image processor's min_pixels / max_pixels: 4 to 64 patches of 28 x 28 after merging."""


def vl_config(tokenizer, *, text: dict | None = None, vision: dict | None = None, family: str = "qwen2_5_vl"):
    """A Qwen2.5-VL (or, family "qwen3_vl", a Qwen3-VL: deepstack features from both vision blocks added to the first
    two decoder layers' outputs) config for `tokenizer` (Qwen-VL's vision tokens in it): a 4-layer text model with
    M-RoPE and a 2-block vision tower by default; `text` / `vision` override either."""
    import transformers

    if family == "qwen3_vl":
        return _qwen3_vl_config(tokenizer, text or {}, vision or {})

    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    text_config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                       vocab_size=len(tokenizer), initializer_range=0.2, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                       **ids)
    text_config.update(text or {})
    half = text_config["hidden_size"] // text_config["num_attention_heads"] // 2  # rotary pairs per head
    text_config["rope_parameters"] = {**text_config["rope_parameters"],  # M-RoPE: time, height, width streams
                                      "mrope_section": [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]}
    vision_config = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                         spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                         in_channels=3, initializer_range=0.2)
    vision_config.update(vision or {})
    vision_config["out_hidden_size"] = text_config["hidden_size"]
    return transformers.Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config,
                                         vision_start_token_id=start, vision_end_token_id=end, image_token_id=image,
                                         video_token_id=video, tie_word_embeddings=False, **ids)


def _qwen3_vl_config(tokenizer, text: dict, vision: dict):
    import transformers

    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    text_config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                       vocab_size=len(tokenizer), initializer_range=0.2, pad_token_id=tokenizer.pad_token_id,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                        "mrope_interleaved": True})
    text_config.update(text)
    vision_config = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                         spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                         deepstack_visual_indexes=[0, 1], initializer_range=0.2)
    vision_config.update(vision)
    vision_config["out_hidden_size"] = text_config["hidden_size"]
    config = transformers.Qwen3VLConfig(text_config=text_config, vision_config=vision_config, image_token_id=image,
                                        video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
                                        tie_word_embeddings=False)
    config.eos_token_id, config.pad_token_id = ids["eos_token_id"], ids["pad_token_id"]
    return config


def save_vl_target(model, tokenizer, out_dir: str) -> str:
    """Save a VL model with its tokenizer (vision tokens, the image-placing chat template) and Qwen2-VL's PIL image
    processor (patch 14, merge 2, VL_IMAGE_PIXELS): a folder extractor.LLM, hsx serve and transformers load."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model.generation_config.pad_token_id = tokenizer.pad_token_id
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")  # a chat's answer ends its turn there
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *(
        [end_of_turn] if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id else [])]
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    patch = int(getattr(model.config.vision_config, "patch_size", 14))
    unit = (patch * 2) ** 2
    Qwen2VLImageProcessorPil(min_pixels=unit * 4, max_pixels=unit * 64, patch_size=patch, merge_size=2,
                             temporal_patch_size=2).save_pretrained(out_dir)
    return out_dir


def vl_tokenizer(tokenizer):
    """`tokenizer` with the chat turn markers, Qwen-VL's vision tokens and the image-placing chat template added (in
    place)."""
    missing = [t for t in CHAT_TOKENS if t not in tokenizer.get_vocab()]
    tokenizer.add_special_tokens({"additional_special_tokens": [*missing, *VISION_TOKENS]})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def default_cache_root() -> str:
    """$HSX_CACHE/reference-vl-target, else ~/.cache/hsx/reference-vl-target."""
    from reference.target import cache_folder

    return cache_folder("reference-vl-target")


@dataclass(frozen=True)
class VLTargetConfig:
    """The reference VL target: sizes, training length and where it is cached. The default (2000 steps of 16
    pictures) takes ~3 min on this 2-core CPU; tests use a much smaller config."""

    hidden_size: int = 128
    """Text model width (4 heads, 2 key/value heads)."""
    num_hidden_layers: int = 4
    """Text decoder layers."""
    vision_hidden_size: int = 64
    """Vision tower width (2 blocks, patch 14, merge 2)."""
    steps: int = 2000
    """Optimizer steps (AdamW, linear warm-up, cosine decay)."""
    batch_size: int = 16
    """Pictures per step."""
    lr: float = 2e-3
    """Peak learning rate."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    train_scenes: int = 4000
    """Training pictures (each with one question and its answer), drawn from `seed`."""
    heldout_scenes: int = 64
    """Held-out pictures (another seed) whose exact-answer accuracy the report records."""
    seed: int = 0
    """Seed of the weights, the pictures and the order."""
    threads: int | None = None
    """torch threads while training (default torch's)."""
    cache_root: str = ""
    """Where built targets are kept (default $HSX_CACHE/reference-vl-target)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "vision_hidden_size", "steps", "batch_size", "train_scenes",
                     "heldout_scenes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.hidden_size % 4:
            raise ValueError(f"hidden_size must be a multiple of 4 (4 heads), got {self.hidden_size}")

    def digest(self) -> str:
        import torch
        import transformers

        fields = {k: v for k, v in asdict(self).items() if k not in ("threads", "cache_root")}
        text = json.dumps({**fields, "build": BUILD_VERSION, "torch": torch.__version__,
                           "transformers": transformers.__version__}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class VLTarget:
    path: str
    report: dict
    cached: bool


# -- scenes ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Item:
    kind: str  # a shape name, or "digit"
    colour: str
    place: str
    digit: int = 0

    def phrase(self) -> str:
        if self.kind == "digit":
            return f"the digit {NUMBERS[self.digit]} in {self.colour}"
        where = "in the middle" if self.place == "middle" else f"on the {self.place}" if self.place in (
            "left", "right") else f"at the {self.place}"
        return f"{'an' if self.colour[0] in 'aeiou' else 'a'} {self.colour} {self.kind} {where}"


@dataclass(frozen=True)
class Scene:
    items: tuple[Item, ...]

    @classmethod
    def draw(cls, rng: random.Random) -> Scene:
        if rng.random() < 0.25:
            return cls((Item("digit", rng.choice(list(COLOURS)), "middle", rng.randrange(10)),))
        places = rng.sample(["left", "right", "top", "bottom"], 2) if rng.random() < 0.4 else [
            rng.choice(list(PLACES))]
        return cls(tuple(Item(rng.choice(SHAPES), rng.choice(list(COLOURS)), p) for p in places))

    def image(self):
        from PIL import Image, ImageDraw, ImageFont

        picture = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "white")
        pen = ImageDraw.Draw(picture)
        r = IMAGE_SIZE // 7
        for item in self.items:
            cx, cy = (int(f * IMAGE_SIZE) for f in PLACES[item.place])
            colour = COLOURS[item.colour]
            if item.kind == "circle":
                pen.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
            elif item.kind == "square":
                pen.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour)
            elif item.kind == "triangle":
                pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
            else:
                font = ImageFont.load_default(size=IMAGE_SIZE * 2 // 3)
                pen.text((cx, cy), str(item.digit), fill=colour, font=font, anchor="mm")
        return picture


def chat(scene: Scene, rng: random.Random) -> tuple[str, str]:
    """A question about `scene` and the answer only the picture gives."""
    items = scene.items
    if items[0].kind == "digit":
        item = items[0]
        question = rng.choice(["What digit is shown?", "Describe the picture.", "What colour is the digit?"])
        if question.startswith("What colour"):
            return question, f"The digit is {item.colour}."
        return question, f"It shows {item.phrase()}."
    kind = rng.choice(["describe", "count", "colour"] if len(items) == 1 else ["describe", "count"])
    if kind == "count":
        return "How many shapes are there?", f"There {'is one shape' if len(items) == 1 else 'are two shapes'}: " + \
            " and ".join(i.phrase() for i in items) + "."
    if kind == "colour":
        return f"What colour is the {items[0].kind}?", f"The {items[0].kind} is {items[0].colour}."
    text = " and ".join(i.phrase() for i in items)
    return "Describe the picture.", text[0].upper() + text[1:] + "."


def image_chats(n: int, seed: int, folder: str, *, answers: bool = True) -> list[dict]:
    """n pictures saved under `folder` (scene-<seed>-<i>.png) and one chat record each: the user's image_url part
    (the file's name, for hsx's --allowed-local-media-path FOLDER) and question, and (with `answers`) the answer."""
    rng = random.Random(seed)
    os.makedirs(folder, exist_ok=True)
    records = []
    for i in range(n):
        scene = Scene.draw(rng)
        name = f"scene-{seed}-{i}.png"
        scene.image().save(os.path.join(folder, name))
        question, answer = chat(scene, rng)
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": name}},
                                                 {"type": "text", "text": question}]}]
        if answers:
            messages.append({"role": "assistant", "content": answer})
        records.append({"id": f"scene-{seed}-{i}", "messages": messages, "answer": answer})
    return records


# -- build ----------------------------------------------------------------------------------------------------------
def build_vl_target(config: VLTargetConfig | None = None, *, progress: bool = True) -> VLTarget:
    config = config or VLTargetConfig()
    root = config.cache_root or default_cache_root()
    folder = os.path.join(root, f"qwen2_5_vl-{config.digest()}")
    if os.path.isfile(os.path.join(folder, REPORT_NAME)):
        with open(os.path.join(folder, REPORT_NAME)) as f:
            return VLTarget(folder, json.load(f), cached=True)
    os.makedirs(root, exist_ok=True)
    temp = os.path.join(root, f".tmp-{uuid.uuid4().hex[:8]}")
    try:
        report = _build(config, temp, progress)
        os.replace(temp, folder)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return VLTarget(folder, report, cached=False)


def _tokenizer(out_dir: str):
    from reference.stdlib_corpus import build_tokenizer

    rng = random.Random(12345)
    texts = []
    for _ in range(3000):
        scene = Scene.draw(rng)
        texts.extend(chat(scene, rng))
    return vl_tokenizer(build_tokenizer(texts, 384, out_dir))


def _samples(processor, scenes_and_chats, image_token_id: int) -> list[dict]:
    """Each (scene, question, answer) as model inputs: ids with the image expanded, labels on the answer alone."""
    out = []
    for scene, question, answer in scenes_and_chats:
        user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        prompt = processor.tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = prompt + answer + "<|im_end|>"
        image = scene.image()
        enc = processor(text=[full], images=[image], return_tensors="pt", return_mm_token_type_ids=True)
        n_prompt = processor(text=[prompt], images=[image], return_tensors="pt")["input_ids"].shape[1]
        ids = enc["input_ids"][0]
        labels = ids.clone()
        labels[:n_prompt] = -100
        out.append({"input_ids": ids, "labels": labels, "mm_token_type_ids": enc["mm_token_type_ids"][0],
                    "pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]})
        assert int((ids == image_token_id).sum()) == 9
    return out


def _batch(samples: list[dict], pad_id: int) -> dict:
    import torch

    width = max(s["input_ids"].shape[0] for s in samples)
    n = len(samples)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    types = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for b, s in enumerate(samples):
        t = s["input_ids"].shape[0]
        ids[b, :t], labels[b, :t], types[b, :t], mask[b, :t] = s["input_ids"], s["labels"], s["mm_token_type_ids"], 1
    return {"input_ids": ids, "labels": labels, "mm_token_type_ids": types, "attention_mask": mask,
            "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
            "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples])}


def _build(config: VLTargetConfig, out_dir: str, progress: bool) -> dict:
    import torch
    import transformers
    from tqdm.auto import tqdm

    from extractor.multimodal import load_processor

    if config.threads:
        torch.set_num_threads(config.threads)
    started = time.time()
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = _tokenizer(out_dir)
    torch.manual_seed(config.seed)
    h = config.hidden_size
    model_config = vl_config(tokenizer, text=dict(hidden_size=h, intermediate_size=2 * h,
                                                  num_hidden_layers=config.num_hidden_layers, initializer_range=0.02),
                             vision=dict(hidden_size=config.vision_hidden_size,
                                         intermediate_size=2 * config.vision_hidden_size, initializer_range=0.02))
    model = transformers.Qwen2_5_VLForConditionalGeneration(model_config)
    save_vl_target(model, tokenizer, out_dir)  # processor files first: training processes through them
    processor = load_processor(out_dir)
    rng = random.Random(config.seed)
    train = []
    for _ in range(config.train_scenes):
        scene = Scene.draw(rng)
        train.append((scene, *chat(scene, rng)))
    samples = _samples(processor, train, model_config.image_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(config.seed)
    losses = []
    model.train()
    bar = tqdm(range(config.steps), desc="reference VL target", disable=not progress, unit="step")
    order, cursor = torch.randperm(len(samples), generator=g), 0
    for step in bar:
        if cursor + config.batch_size > len(order):
            order, cursor = torch.randperm(len(samples), generator=g), 0
        picked = [samples[i] for i in order[cursor:cursor + config.batch_size].tolist()]
        cursor += config.batch_size
        lr = config.lr * min(1.0, (step + 1) / config.warmup_steps) * 0.5 * (1 + math.cos(math.pi * step / config.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(**_batch(picked, tokenizer.pad_token_id)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    model.eval()
    accuracy = _heldout_accuracy(model, processor, config)
    save_vl_target(model, tokenizer, out_dir)
    report = {"config": asdict(config), "final_loss": sum(losses[-20:]) / min(20, len(losses)),
              "loss_curve": losses[::10], "heldout_answer_accuracy": accuracy,
              "seconds": round(time.time() - started, 1)}
    with open(os.path.join(out_dir, REPORT_NAME), "w") as f:
        json.dump(report, f, indent=1)
    return report


def heldout_seed(config: VLTargetConfig) -> int:
    return config.seed + 1_000_003


def _heldout_accuracy(model, processor, config: VLTargetConfig) -> float:
    """Share of held-out questions (scenes of another seed) the target answers exactly, greedy."""
    import torch

    rng = random.Random(heldout_seed(config))
    right = 0
    for _ in range(config.heldout_scenes):
        scene = Scene.draw(rng)
        question, answer = chat(scene, rng)
        user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        prompt = processor.tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        enc = processor(text=[prompt], images=[scene.image()], return_tensors="pt", return_mm_token_type_ids=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=32, do_sample=False)
        text = processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        right += text.strip() == answer
    return right / config.heldout_scenes


def main(argv: list[str] | None = None) -> None:
    """python -m reference.vl_target [--steps N]: build (or find) the reference VL target, print it."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--steps", type=int, default=VLTargetConfig.steps)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cache-root", default="")
    args = p.parse_args(argv)
    target = build_vl_target(VLTargetConfig(steps=args.steps, threads=args.threads, cache_root=args.cache_root))
    print(json.dumps({"path": target.path, "cached": target.cached,
                      **{k: v for k, v in target.report.items() if k != "loss_curve"}}, indent=1))


if __name__ == "__main__":
    main()
