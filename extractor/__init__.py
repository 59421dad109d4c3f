"""hsx extractor: the offline engine with the `extract_hidden_states` pseudo-drafter.

    llm.py          LLM (vLLM's offline API; LLM.from_config(EngineConfig) for typed callers), RequestOutput,
                    CompletionOutput
    config.py       EngineConfig, speculative_config parsing, the one dtype table and "auto" dtype rule
    sampling.py     SamplingParams and the sampler
    runner.py       ModelRunner: model loading, chunked prefill, decode steps
    layers.py       layer-id semantics, the capture hooks, early exit
    batching.py     token-budget batches grouped by length
"""

from extractor.config import EngineConfig
from extractor.llm import LLM, CompletionOutput, RequestOutput
from extractor.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
