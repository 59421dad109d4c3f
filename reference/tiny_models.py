"""Small random causal LMs and a locally trained tokenizer — for tests, the demo job and benchmarks.

No downloads: the tokenizer is a byte-level BPE trained on text generated here, the models are built from
transformers configs with random weights and saved with `save_pretrained`, so every code path that loads a real
checkpoint from a folder is exercised.

    build_tokenizer(dir)                        -> PreTrainedTokenizerFast with a chat template, saved to dir
    build_tiny_model(family, dir, **overrides)  -> dir holding config, weights and tokenizer
    build_tiny_vl_model(dir)                    -> a Qwen2.5-VL-style target with its image processor
    sample_text(n, seed)                        -> deterministic English-like sentences
"""

from __future__ import annotations

import os
import random

_WORDS = ("the a model layer token hidden state drafter speculative decoding train data run fast slow small large "
          "cat dog tree river mountain city light dark green blue red old new quick lazy jumps over under near far "
          "write read store load batch worker cluster node disk cloud bucket file path byte number value one two "
          "three four five six seven eight nine ten is was are were has have had will would can could should").split()

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def sample_text(n: int, seed: int = 0, min_words: int = 3, max_words: int = 40) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))]
        out.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
    return out


def build_tokenizer(out_dir: str, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on generated text; save and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sample_text(2000, seed=1234), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                 bos_token=None, unk_token=None)
    hf.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
    return hf


_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_DEEPSEEK_MOE = dict(_MOE, n_routed_experts=4, first_k_dense_replace=1, n_group=1, topk_group=1)
_LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
SLIDING_WINDOW = 8
"""The tiny windowed families' window: shorter than the tests' prompts, so the window is exercised."""

FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    # today's seven (the engine's first families) ...
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "mistral": ("MistralConfig", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_MOE, head_dim=16, num_experts=4, decoder_sparse_step=1)),
    "qwen2": ("Qwen2Config", {}),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    # ... and the families drafters are trained for now: windows, MLA, MoE, hybrids, post-norms, multipliers
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=SLIDING_WINDOW)),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=SLIDING_WINDOW, sliding_window_pattern=2)),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, sliding_window=SLIDING_WINDOW, num_local_experts=4,
                                     num_experts_per_tok=2)),
    "exaone4": ("Exaone4Config", dict(sliding_window=SLIDING_WINDOW)),
    "deepseek_v3": ("DeepseekV3Config", dict(_DEEPSEEK_MOE, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32,
                                             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)),
    "glm4_moe": ("Glm4MoeConfig", dict(_DEEPSEEK_MOE, head_dim=16)),
    "qwen3_next": ("Qwen3NextConfig", dict(_LINEAR, **_MOE, head_dim=16, num_experts=4)),
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(_LINEAR, head_dim=16)),
    "llama4_text": ("Llama4TextConfig", dict(head_dim=16, num_local_experts=2, intermediate_size_mlp=128)),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", dict(embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0)),
    "falcon_h1": ("FalconH1Config", {}),
    "mamba": ("MambaConfig", dict(state_size=8)),
}
"""family -> (transformers config class, its tiny sizes beyond the common ones). Also "gpt2", and "qwen3_5" (a
Qwen3.5 text target declared through its vision-language config, the text model in `text_config`)."""

FAMILIES = ("llama", "qwen3", "mistral", "qwen3_moe", "gpt2", *[f for f in FAMILY_CONFIGS if f not in
                                                               ("llama", "qwen3", "mistral", "qwen3_moe")], "qwen3_5")


def _config(family: str, vocab_size: int, eos_id: int, pad_id: int, **overrides):
    import transformers

    common = dict(vocab_size=vocab_size, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None,
                  tie_word_embeddings=False, initializer_range=0.2)
    if family == "gpt2":
        kw = dict(n_embd=64, n_layer=4, n_head=4, n_positions=2048, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        kw.update(common)
        kw.update(overrides)
        return transformers.GPT2Config(**kw)
    if family == "qwen3_5":  # the vision-language config; AutoModelForCausalLM builds its text model
        text = _config("qwen3_5_text", vocab_size, eos_id, pad_id, **overrides).to_dict()
        return transformers.Qwen3_5Config(text_config=text, tie_word_embeddings=False)
    if family not in FAMILY_CONFIGS:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {list(FAMILIES)}")
    cls_name, extra = FAMILY_CONFIGS[family]
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6)
    kw.update(extra)
    kw.update(common)
    kw.update(overrides)
    return getattr(transformers, cls_name)(**kw)


def build_tiny_model(family: str, out_dir: str, *, seed: int = 0, dtype: str = "float32", **overrides) -> str:
    """Build a random `family` model with the local tokenizer, save both to `out_dir`, return `out_dir`.

    `overrides` go to the config (e.g. num_hidden_layers=8, hidden_size=128). initializer_range is large so that
    greedy decoding has clear winners (no argmax ties between near-equal logits).
    """
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(out_dir)
    vocab = overrides.pop("vocab_size", len(tokenizer))  # larger than the tokenizer's: ids it never produces
    config = _config(family, vocab, tokenizer.eos_token_id, tokenizer.pad_token_id, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    return out_dir


def build_tiny_vl_model(out_dir: str, *, seed: int = 0, dtype: str = "float32", text: dict | None = None,
                        vision: dict | None = None, family: str = "qwen2_5_vl") -> str:
    """A random Qwen2.5-VL-style target (transformers' Qwen2_5_VLForConditionalGeneration: a 2-block vision tower,
    a 4-layer text model with M-RoPE) with the local tokenizer (Qwen-VL's vision tokens added), a chat template that
    places images, and Qwen2-VL's PIL image processor (patch 14, merge 2), saved to `out_dir`; returns it.
    `text` / `vision` override the text and vision configs."""
    import torch
    import transformers

    from reference.vl_target import save_vl_target, vl_config, vl_tokenizer

    tokenizer = vl_tokenizer(build_tokenizer(out_dir))
    torch.manual_seed(seed)
    config = vl_config(tokenizer, text=text, vision=vision, family=family)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    return save_vl_target(model.to(getattr(torch, dtype)), tokenizer, out_dir)


def randomise_norms(model_dir: str, seed: int = 2, scale: float = 0.3) -> str:
    """Add scale * N(0, 1) to every norm weight of the model at `model_dir` (a fresh model's are all 1 or all 0, so a
    missing or misplaced norm would go unnoticed) and save it back; returns model_dir."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() and "weight" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(model_dir)
    return model_dir


MTP_FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_text")
"""Tiny families whose checkpoints can carry MTP layers (add_mtp_layers), in the layout their real checkpoints ship."""


def add_mtp_layers(model_dir: str, count: int = 1, *, seed: int = 0, own_copies: bool = False) -> str:
    """Append `count` random MTP layers to the tiny target at `model_dir` (built by build_tiny_model from one of
    MTP_FAMILIES) in its family's checkpoint layout, and declare them in config.json — what a real checkpoint that
    ships MTP heads looks like, written from the layout itself (not from hsx's reader):

        deepseek_v3, glm4_moe   model.layers.{N+j}.{enorm,hnorm,eh_proj,shared_head.norm}.weight + a decoder layer's
                                tensors under model.layers.{N+j}.; num_nextn_predict_layers = count; own_copies adds
                                per-layer embed_tokens / shared_head.head (DeepSeek-V3 ships copies of the target's;
                                these differ from them a little, so that which one a reader uses shows)
        qwen3_next, qwen3_5_text  mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}.weight + mtp.layers.{j}.*
                                (full-attention decoder layers); num_nextn_predict_layers (qwen3_next) /
                                mtp_num_hidden_layers (qwen3_5) = count
    Norm weights are randomised (a wrong norm shows). Returns model_dir."""
    import copy
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from extractor.layers import find_decoder

    config = AutoConfig.from_pretrained(model_dir)
    family = config.model_type
    if family not in MTP_FAMILIES:
        raise ValueError(f"{model_dir}: model_type {family!r} has no MTP layout here; choose one of {MTP_FAMILIES}")
    n, h = int(config.num_hidden_layers), int(config.hidden_size)
    qwen = family.startswith("qwen")
    block_config = copy.deepcopy(config)
    block_config._attn_implementation = "sdpa"
    if getattr(block_config, "layer_types", None) is not None:
        block_config.layer_types = ["full_attention"] * (n + count)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    layer_cls = type(find_decoder(skeleton, n)[2][0])
    del skeleton
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    std = float(getattr(config, "initializer_range", 0.02))
    tensors: dict[str, torch.Tensor] = {}

    def norm() -> torch.Tensor:  # around the family's neutral value (1 for x*w, 0 for x*(1+w)), randomised
        return (0.0 if qwen else 1.0) + 0.3 * torch.randn(h, generator=g)

    def parts(prefix: str, names: tuple[str, str, str, str]) -> None:
        e, hn, proj, out = names
        tensors[prefix + e] = norm()
        tensors[prefix + hn] = norm()
        tensors[prefix + proj] = torch.randn(h, 2 * h, generator=g) * std
        tensors[prefix + out] = norm()

    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    if qwen:
        parts("mtp.", ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "fc.weight", "norm.weight"))
    for j in range(count):
        layer = layer_cls(block_config, j if qwen else n + j)
        prefix = f"mtp.layers.{j}." if qwen else f"model.layers.{n + j}."
        tensors.update(_random_layer(layer, prefix, h, norm, std, g))
        if not qwen:
            parts(prefix, ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"))
            if own_copies:
                embed = weights["model.embed_tokens.weight"]
                head = weights.get("lm_head.weight", embed)
                tensors[prefix + "embed_tokens.weight"] = embed + 0.5 * std * torch.randn(embed.shape, generator=g)
                tensors[prefix + "shared_head.head.weight"] = head + 0.5 * std * torch.randn(head.shape, generator=g)
    dtype = next(iter(weights.values())).dtype
    weights.update({k: v.to(dtype).contiguous() for k, v in tensors.items()})
    save_file(weights, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        doc = json.load(f)
    doc["mtp_num_hidden_layers" if family == "qwen3_5_text" else "num_nextn_predict_layers"] = count
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    return model_dir


def _random_layer(layer, prefix: str, h: int, norm, std: float, g) -> dict:
    """A fresh decoder layer's tensors under `prefix`, random as a trained checkpoint's would be (norms around the
    family's neutral value, fused experts stored per expert as checkpoints store them)."""
    import torch

    tensors = {}
    for name, p in layer.state_dict().items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            tensors[prefix + name] = norm() if p.shape == (h,) else p + 0.3 * torch.randn(p.shape, generator=g)
        elif p.is_floating_point() and p.dim() == 3 and name.endswith(("experts.gate_up_proj",
                                                                        "experts.down_proj")):
            # fused in transformers' module, stored per expert in checkpoints (gate and up along dim 0)
            stem, fused = name.rsplit("experts.", 1)
            for e in range(p.shape[0]):
                if fused == "down_proj":
                    tensors[f"{prefix}{stem}experts.{e}.down_proj.weight"] = torch.randn(p.shape[1:], generator=g) * std
                else:
                    for proj in ("gate_proj", "up_proj"):
                        tensors[f"{prefix}{stem}experts.{e}.{proj}.weight"] = \
                            torch.randn(p.shape[1] // 2, p.shape[2], generator=g) * std
        elif p.is_floating_point() and p.dim() >= 2:
            tensors[prefix + name] = torch.randn(p.shape, generator=g) * std
        elif p.is_floating_point():  # biases, DeepSeek's routing bias: small random values (a fresh module
            tensors[prefix + name] = 0.1 * torch.randn(p.shape, generator=g)  # may hold uninitialised memory)
        else:
            tensors[prefix + name] = p.clone()
    return tensors
