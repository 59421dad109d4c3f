"""Real vLLM as an engine kind, `--engine vllm`: entry point `hsx.engines` `vllm = "vllm_engine.kind:KIND"`. The
members are extractor.engines.EngineKind's. Imports no vLLM (nor torch): the registry loads this module to check a
job's flags; vLLM itself loads when `build` or `speculative_engine` is called.

    KIND      VllmKind(): vLLM's kernels, model coverage and parallelism (VllmSettings) with hsx's connector
              plug-in; layer states only (no top-k target), no image samples; files written by vLLM's own
              processes, each keeping vLLM's <file>.lock on a local disk
"""

from __future__ import annotations

from typing import Any

from extractor.engines import EngineFlags
from vllm_engine.options import VllmSettings, vllm_missing


class VllmKind:
    name = "vllm"
    checks_model = False  # vLLM decides what it builds and how it batches
    images = False
    files_in_process = False  # the plug-in writes from vLLM's engine-core processes
    lock_files = True  # vLLM's load_hidden_states opens <file>.lock

    def missing(self) -> str | None:
        return vllm_missing()

    def settings(self, flags: EngineFlags) -> VllmSettings:
        if flags.target != "states":
            raise ValueError(f"--target {flags.target} needs the final norm and lm_head applied inside the engine; "
                             "--engine vllm stores layer states: use --engine hsx for a top-k target")
        return VllmSettings(tensor_parallel_size=flags.tensor_parallel_size,
                            pipeline_parallel_size=flags.pipeline_parallel_size,
                            enable_expert_parallel=flags.enable_expert_parallel, engine_args=dict(flags.vllm_args))

    def ranks(self, settings: VllmSettings) -> int:
        return settings.devices  # an engine of T x P ranks: a gang of that many whole devices

    def quantization(self, settings: VllmSettings) -> str:
        method = settings.engine_args.get("quantization")
        return f"{method} (vLLM, on the fly)" if method else ""

    def build(self, config, connector, settings: VllmSettings):
        from vllm_engine.engine import VllmEngine  # vLLM

        return VllmEngine(config, connector, settings)

    def speculative_engine(self) -> Any:
        from vllm_engine.speculative import VllmSpeculativeLLM  # vLLM

        return VllmSpeculativeLLM


KIND = VllmKind()
