"""What a job knows about its target model before any weights load: from the model's config alone.

    ModelFacts.resolve(config) -> ModelFacts    layers, dtype, sizes, length limit, identity (revision, fingerprint)

The driver uses these to write and check run.json, the tokenizer stage to apply the length limit, `hsx estimate` to
size a run, and every worker passes the resolved values to its engine, so all sides agree.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from connectors.format import HiddenStatesSpec, check_layer_ids
from jobs.config import JobConfig

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class ModelFacts:
    model: str
    """The model as the engine loads it: an absolute folder for local models, else the hub id."""
    revision: str
    """Commit hash or revision, when known ("" for local folders)."""
    fingerprint: str
    """"v2:" + sha256 prefix over the model folder's config, tokenizer and template files (their bytes) and each
    weight file's name, size, mtime and safetensors header — weights re-written in place change it; a hub id: of
    its config. See `model_fingerprint(model, hf, scheme)`."""
    legacy_fingerprint: str
    """The first round's fingerprint (config + weight sizes), to resume runs that recorded it."""
    architecture: str
    num_hidden_layers: int
    hidden_size: int
    layer_ids: tuple[int, ...]
    dtype: str
    """Resolved torch dtype name (never "auto")."""
    max_model_len: int

    def file_spec(self) -> HiddenStatesSpec:
        """The spec every file of this model carries: the one the engine builds (extractor.LLM)."""
        return HiddenStatesSpec(layer_ids=self.layer_ids, num_hidden_layers=self.num_hidden_layers,
                                hidden_size=self.hidden_size, dtype=self.dtype, model=self.model,
                                model_revision=self.revision, last_layer_normalized=False,
                                extra={"architecture": self.architecture})

    @classmethod
    def resolve(cls, config: JobConfig) -> ModelFacts:
        from transformers import AutoConfig

        from extractor.config import resolve_dtype
        from extractor.layers import default_layer_ids

        model = os.path.abspath(os.path.expanduser(config.model)) if os.path.isdir(
            os.path.expanduser(config.model)) else config.model
        try:
            hf = AutoConfig.from_pretrained(model, revision=config.revision,
                                            trust_remote_code=config.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ValueError(f"--model {config.model!r}: cannot read its config ({e}). Pass a local model folder or "
                             "a hub id that is already downloaded") from e
        n, h = int(hf.num_hidden_layers), int(hf.hidden_size)
        layer_ids = check_layer_ids(config.layers if config.layers is not None else default_layer_ids(n), n,
                                    name=f"--layers (for {config.model})")
        dtype = resolve_dtype(config.dtype, hf)  # the engine's own rule
        max_len = config.max_model_len or getattr(hf, "max_position_embeddings", None) or 2048
        if config.max_tokens >= max_len:
            raise ValueError(f"--max-tokens {config.max_tokens} leaves no room for a prompt within the model's "
                             f"length limit {max_len}; lower --max-tokens or raise --max-model-len")
        return cls(model=model, revision=str(getattr(hf, "_commit_hash", None) or config.revision or ""),
                   fingerprint=model_fingerprint(model, hf),
                   legacy_fingerprint=model_fingerprint(model, hf, scheme=""), architecture=",".join(getattr(hf, "architectures", None) or []),
                   num_hidden_layers=n, hidden_size=h, layer_ids=layer_ids, dtype=dtype, max_model_len=int(max_len))


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
        if not name.endswith(_WEIGHT_SUFFIXES):
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
    import struct

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        (n,) = struct.unpack("<Q", head)
        return head + f.read(min(n, 100_000_000))
