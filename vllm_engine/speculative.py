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

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from extractor.llm import CompletionOutput, RequestOutput
from extractor.methods import family
from extractor.sampling import SamplingParams
from vllm_engine.engine import VllmMissing
from vllm_engine.options import INSTALL_HINT


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


def _checkpoint_dtype(model: str) -> str:
    """The target checkpoint's dtype (vLLM's "auto" may pick another on some platforms): config.json's."""
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return "auto"
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if isinstance(dtype, str) else "auto"


class VllmSpeculativeLLM:
    """See the module docstring."""

    def __init__(self, model: str, speculative_config: Mapping[str, Any] | None = None, device: str | None = None,
                 max_num_seqs: int | None = None) -> None:
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as e:
            raise VllmMissing(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from None
        args: dict[str, Any] = {"enforce_eager": True} if current_platform.is_cpu() else {}
        if max_num_seqs:
            args["max_num_seqs"] = max_num_seqs
        self._llm = vllm.LLM(model=model, dtype=_checkpoint_dtype(model), disable_log_stats=False,
                             speculative_config=vllm_speculative_config(speculative_config), **args)

    def generate(self, prompts: Sequence[str | Mapping[str, Any]], params: SamplingParams,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        from vllm import SamplingParams as VllmParams

        vparams = VllmParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                             top_k=params.top_k or 0, seed=params.seed, ignore_eos=params.ignore_eos,
                             stop=params.stop, stop_token_ids=list(params.stop_token_ids))
        results = self._llm.generate(list(prompts), vparams, use_tqdm=use_tqdm)
        return [RequestOutput(request_id=str(r.request_id), prompt=r.prompt,
                              prompt_token_ids=list(r.prompt_token_ids or []),
                              outputs=[CompletionOutput(0, c.text, list(c.token_ids), c.finish_reason, c.stop_reason)
                                       for c in r.outputs[:1]]) for r in results]

    def get_metrics(self):
        return self._llm.get_metrics()

    def shutdown(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            self._llm = None
