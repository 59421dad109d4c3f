"""A model's identity, as run.json records it (the run format's owner keeps it, so every reader compares alike).

    model_fingerprint(model, hf, scheme)   "v2:" + sha256 prefix over a local model folder's config, tokenizer and
                                           template files (their bytes) and each weight file's name, size, mtime
                                           and safetensors header; a hub id: of its config (`hf.to_dict()`).
                                           scheme "" is the first round's (config.json + weight names and sizes)
    FINGERPRINT_SCHEME                     the prefix of fingerprints written now
    model_quantization(hf)                 a checkpoint's quantization_config in short: "fp8 (fmt=e4m3,
                                           weight_block_size=[128, 128], activation_scheme=dynamic)"; "" unquantized

`hf` is any object with `to_dict()` (a transformers PretrainedConfig): this module never imports transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Weight files of a model folder, as the fingerprint hashes them."""
FINGERPRINT_SCHEME = "v2:"
# small files that shape what the engine computes or how text becomes ids: hashed byte for byte
_IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
                   "vocab.txt", "merges.txt", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.json", "chat_template.jinja")


def model_fingerprint(model: str, hf, scheme: str = FINGERPRINT_SCHEME) -> str:
    """The model's identity for run.json. `scheme` "v2:" (written now) or "" (the first round's, to check runs that
    recorded it: config.json and weight names and sizes only)."""
    digest = hashlib.sha256()
    if not os.path.isdir(model):
        digest.update(json.dumps(hf.to_dict(), sort_keys=True, default=str).encode())
        return scheme + digest.hexdigest()[:16]
    names = sorted(os.listdir(model))
    for name in names:
        path = os.path.join(model, name)
        if name == "config.json" or (scheme and (name in _IDENTITY_FILES or name.endswith(".jinja"))):
            with open(path, "rb") as f:
                digest.update(f"{name}\n".encode() + f.read() if scheme else f.read())
    for name in names:
        if not name.endswith(WEIGHT_SUFFIXES):
            continue
        path = os.path.join(model, name)
        st = os.stat(path)
        if not scheme:
            digest.update(f"{name}:{st.st_size}\n".encode())
            continue
        digest.update(f"{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        if name.endswith(".safetensors"):
            digest.update(_safetensors_header(path))
    return scheme + digest.hexdigest()[:16]


def _safetensors_header(path: str) -> bytes:
    """The header (tensor names, dtypes, shapes, offsets) of a safetensors file: 8 + N bytes, however large it is."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        (n,) = struct.unpack("<Q", head)
        return head + f.read(min(n, 100_000_000))


# quantization_config keys that change what the model computes, in the order they are shown (the rest — module lists,
# kernels' switches — stay in config.json, which the fingerprint hashes)
_QUANT_KEYS = ("fmt", "weight_block_size", "activation_scheme", "bits", "group_size", "sym", "desc_act", "zero_point",
               "weight_dtype", "format", "version", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type",
               "bnb_4bit_compute_dtype", "bnb_4bit_use_double_quant")


def model_quantization(hf) -> str:
    """The checkpoint's quantization as run.json records it: quant_method and the keys that change numerics, e.g.
    "fp8 (fmt=e4m3, weight_block_size=[128, 128], activation_scheme=dynamic)", "mxfp4"; "" when the config has no
    quantization_config (a multimodal wrapper's top-level config is read first, then its text config's)."""
    doc = hf if isinstance(hf, dict) else hf.to_dict()
    quant = doc.get("quantization_config")
    if not quant and isinstance(doc.get("text_config"), dict):
        quant = doc["text_config"].get("quantization_config")
    if not quant:
        return ""
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else {"quant_method": str(quant)}
    method = str(quant.get("quant_method") or "unknown")
    shown = [f"{k}={_short(quant[k])}" for k in _QUANT_KEYS if quant.get(k) is not None]
    return f"{method} ({', '.join(shown)})" if shown else method


def _short(value) -> str:
    return json.dumps(value) if isinstance(value, (list, dict, bool)) else str(value)
