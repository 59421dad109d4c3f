"""Speculative decoding in real vLLM behind the calls `hsx eval-drafter` makes of an engine (training/evaluate.py):
`VllmSpeculativeLLM(model=..., speculative_config=..., device=..., max_num_seqs=...)`, then `generate(prompts,
params, use_tqdm)`, `get_metrics()` (vLLM's own counters, the names hsx's engine mirrors) and `shutdown()`.

    vllm_speculative_config(config)   hsx's speculative_config as vLLM takes it: a drafter family's method becomes
                                      the method vLLM serves its checkpoints with (P-EAGLE: eagle3 +
                                      parallel_drafting); ngram and draft_model pass as they are

vLLM refuses what it cannot serve with its own message (vLLM 0.32: mlp_speculator, whose model class it has
disabled): the evaluation records it as that method's error. Outputs carry no per-request counts (hsx's
`RequestOutput.spec_decode`): acceptance per prompt category needs hsx's engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from extractor.config import resolve_dtype
from extractor.llm import CompletionOutput, RequestOutput
from extractor.methods import family
from extractor.sampling import SamplingParams
from vllm_engine.engine import import_vllm, platform_args, shutdown_llm, vllm_sampling_params


def vllm_speculative_config(config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """hsx's speculative_config -> vLLM's (see the module docstring); None stays None (plain decoding)."""
    if config is None:
        return None
    out = dict(config)
    drafter = family(str(out.get("method")))
    parallel_of = getattr(drafter, "parallel_of", None) if drafter is not None else None
    if parallel_of:  # a family vLLM serves as another method's parallel drafting (P-EAGLE: eagle3)
        out["method"], out["parallel_drafting"] = parallel_of, True
    return out


class VllmSpeculativeLLM:
    """See the module docstring."""

    def __init__(self, model: str, speculative_config: Mapping[str, Any] | None = None, device: str | None = None,
                 max_num_seqs: int | None = None) -> None:
        vllm = import_vllm()
        from transformers import AutoConfig

        args = platform_args()
        if max_num_seqs:
            args["max_num_seqs"] = max_num_seqs
        # "auto" as hsx's engine resolves it (vLLM's own "auto" may pick another dtype on some platforms)
        dtype = resolve_dtype("auto", AutoConfig.from_pretrained(model))
        self._llm = vllm.LLM(model=model, dtype=dtype, disable_log_stats=False,
                             speculative_config=vllm_speculative_config(speculative_config), **args)

    def generate(self, prompts: Sequence[str | Mapping[str, Any]], params: SamplingParams,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        results = self._llm.generate(list(prompts), vllm_sampling_params(params), use_tqdm=use_tqdm)
        return [RequestOutput(request_id=str(r.request_id), prompt=r.prompt,
                              prompt_token_ids=list(r.prompt_token_ids or []),
                              outputs=[CompletionOutput(0, c.text, list(c.token_ids), c.finish_reason, c.stop_reason)
                                       for c in r.outputs[:1]]) for r in results]

    def get_metrics(self):
        return self._llm.get_metrics()

    def shutdown(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            shutdown_llm(llm)
            self._llm = None
