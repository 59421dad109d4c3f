"""A model's identity, as run.json records it (the run format's owner keeps it, so every reader compares alike).

    model_fingerprint(model, hf, scheme)   "v2:" + sha256 prefix over a local model folder's config, tokenizer and
                                           template files (their bytes) and each weight file's name, size, mtime
                                           and safetensors header; a hub id: of its config (`hf.to_dict()`).
                                           scheme "" is the first round's (config.json + weight names and sizes)
    FINGERPRINT_SCHEME                     the prefix of fingerprints written now

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
