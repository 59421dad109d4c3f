"""Small random causal LMs and a locally trained tokenizer — for tests, the demo job and benchmarks.

No downloads: the tokenizer is a byte-level BPE trained on text generated here, the models are built from
transformers configs with random weights and saved with `save_pretrained`, so every code path that loads a real
checkpoint from a folder is exercised.

    build_tokenizer(dir)                        -> PreTrainedTokenizerFast with a chat template, saved to dir
    build_tiny_model(family, dir, **overrides)  -> dir holding config, weights and tokenizer
    sample_text(n, seed)                        -> deterministic English-like sentences
"""

from __future__ import annotations

import os
import random

FAMILIES = ("llama", "qwen3", "mistral", "qwen3_moe", "gpt2")

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


def _config(family: str, vocab_size: int, eos_id: int, pad_id: int, **overrides):
    import transformers

    common = dict(vocab_size=vocab_size, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None,
                  tie_word_embeddings=False, initializer_range=0.2)
    if family == "gpt2":
        kw = dict(n_embd=64, n_layer=4, n_head=4, n_positions=2048, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        kw.update(common)
        kw.update(overrides)
        return transformers.GPT2Config(**kw)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6)
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
           "mistral": transformers.MistralConfig, "qwen3_moe": transformers.Qwen3MoeConfig}.get(family)
    if cls is None:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {list(FAMILIES)}")
    if family == "qwen3":
        kw["head_dim"] = 16
    if family == "qwen3_moe":
        kw.update(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    kw.update(common)
    kw.update(overrides)
    return cls(**kw)


def build_tiny_model(family: str, out_dir: str, *, seed: int = 0, dtype: str = "float32", **overrides) -> str:
    """Build a random `family` model with the local tokenizer, save both to `out_dir`, return `out_dir`.

    `overrides` go to the config (e.g. num_hidden_layers=8, hidden_size=128). initializer_range is large so that
    greedy decoding has clear winners (no argmax ties between near-equal logits).
    """
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(out_dir)
    config = _config(family, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    return out_dir
