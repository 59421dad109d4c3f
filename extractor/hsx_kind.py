"""hsx's own engine (extractor.LLM) as an engine kind, `--engine hsx` (the default): entry point `hsx.engines`
`hsx = "extractor.hsx_kind:KIND"`. The members are extractor.engines.EngineKind's; torch loads only when an engine
is built.

    KIND      HsxKind(): any Hugging Face causal LM through transformers, exact; one model copy per worker, on one
              device or a share of one; image samples; top-k targets; files written in the worker's process
"""

from __future__ import annotations

from typing import Any

from extractor.engines import EngineFlags
from extractor.options import flag


class HsxKind:
    name = "hsx"
    checks_model = True  # hsx builds the model with transformers (extractor.facts.check_runnable, packing)
    images = True
    files_in_process = True
    lock_files = False

    def missing(self) -> str | None:
        return None  # torch and transformers are hsx's own dependencies

    def settings(self, flags: EngineFlags) -> None:
        """None: hsx's engine has no settings beyond the engine config; vLLM's flags are refused, each named."""
        unset = EngineFlags(target=flags.target)  # every vLLM flag at its default
        given = [flag(name) for name in ("tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
                                         "vllm_args") if getattr(flags, name) != getattr(unset, name)]
        if given:
            raise ValueError(f"{', '.join(given)}: settings of vLLM's engine; add --engine vllm (hsx's engine "
                             "runs one model copy per worker)")
        return None

    def ranks(self, settings: None) -> None:
        return None  # one device, or a share of one (--gpus-per-worker 0.5)

    def quantization(self, settings: None) -> str:
        return ""  # the checkpoint as transformers loads it (run.json's model_quantization says what it is)

    def build(self, config, connector, settings: None):
        from connectors import KVTransferConfig
        from extractor.llm import LLM  # torch

        return LLM.from_config(config, KVTransferConfig(kv_connector="SafetensorsHiddenStatesConnector",
                                                        kv_connector_extra_config=connector))

    def speculative_engine(self) -> Any:
        from extractor.llm import LLM  # torch

        return LLM


KIND = HsxKind()
