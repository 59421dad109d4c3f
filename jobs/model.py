"""What a job knows about its target model before any weights load: from the model's config alone.

    ModelFacts.resolve(config) -> ModelFacts    extractor.facts' TargetFacts of the job's model + its fingerprint

The driver uses these to write and check run.json, the tokenizer stage to apply the length limit, `hsx estimate` to
size a run, and every worker passes the resolved values to its engine, so all sides agree.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from connectors.fingerprint import model_fingerprint, model_quantization
from drafters.registry import default_layer_ids
from extractor.facts import TargetFacts, check_runnable, target_facts, text_config
from jobs.config import JobConfig


@dataclass(frozen=True)
class ModelFacts(TargetFacts):
    """The engine's facts of the model (extractor.facts.TargetFacts: model as the engine loads it — an absolute
    folder for local models, else the hub id —, revision, layers, dtype, sizes, length limit) and its identity."""

    fingerprint: str = ""
    """"v2:" + sha256 prefix over the model folder's config, tokenizer and template files (their bytes) and each
    weight file's name, size, mtime and safetensors header — weights re-written in place change it; a hub id: of
    its config. See connectors.fingerprint."""
    legacy_fingerprint: str = ""
    """The first round's fingerprint (config + weight sizes), to resume runs that recorded it."""
    quantization: str = ""
    """The checkpoint's quantization_config in short (connectors.fingerprint.model_quantization); "" unquantized."""

    @classmethod
    def resolve(cls, config: JobConfig) -> ModelFacts:
        from transformers import AutoConfig

        model = os.path.abspath(os.path.expanduser(config.model)) if os.path.isdir(
            os.path.expanduser(config.model)) else config.model
        try:
            hf = AutoConfig.from_pretrained(model, revision=config.revision,
                                            trust_remote_code=config.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ValueError(f"--model {config.model!r}: cannot read its config ({e}). Pass a local model folder or "
                             "a hub id that is already downloaded") from e
        # hsx's engine: what transformers builds and packs (vLLM decides for itself, extractor.engines)
        checks_model = config.engine_kind().checks_model
        if checks_model:
            check_runnable(hf, model)
        # the default layers serve every registered family (what each declares it reads: drafters.features)
        layer_ids = config.layers or default_layer_ids(int(text_config(hf).num_hidden_layers))
        # the engine's own derivation (extractor.facts): layers, dtype, length limit as the workers will see them
        f = target_facts(hf, model=model, revision=config.revision, layer_ids=layer_ids, dtype=config.dtype,
                         max_model_len=config.max_model_len, layers_flag="--layers", target=config.engine_target,
                         target_flag="--target")
        if checks_model:  # what hsx's engine packs
            from extractor.packing import check_packing_mode  # torch

            check_packing_mode(hf, config.packing, model)
        max_len = f.max_model_len
        if config.max_tokens >= max_len:
            raise ValueError(f"--max-tokens {config.max_tokens} leaves no room for a prompt within the model's "
                             f"length limit {max_len}; lower --max-tokens or raise --max-model-len")
        return cls(**dataclasses.asdict(f), fingerprint=model_fingerprint(model, hf),
                   legacy_fingerprint=model_fingerprint(model, hf, scheme=""),
                   quantization=model_quantization(hf))
