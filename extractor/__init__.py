"""hsx extractor: the offline engine with the `extract_hidden_states` pseudo-drafter and speculative decoding.

    llm.py          LLM (vLLM's offline API; LLM.from_config(EngineConfig) for typed callers), RequestOutput,
                    CompletionOutput, get_metrics(), abort_request
    scheduler.py    Scheduler: prompt-only batches, continuous batching of generating requests; Aborts
    speculative.py  speculative_step: propose, verify in one target forward, roll back, count acceptance
    request.py      Request: one request's state inside the engine
    stopping.py     Stopping: EOS, stop token ids, stop strings (incremental detokenization), length limits
    config.py       EngineConfig, SpeculativeConfig, speculative_config parsing, the one dtype table and "auto" rule
    options.py      EngineOptions: the model / engine / output settings hsx run and hsx serve share, flag names
    sampling.py     SamplingParams and the sampler
    facts.py        TargetFacts / target_facts: a model's file spec and limits from its config (no weights)
    runner.py       ModelRunner: model loading, chunked prefill, decode steps, multi-token steps with per-row rollback
    batch_state.py  BatchState / Captured: a batch's cache and its rows' columns (rollback, merge, compact)
    proposers.py    Proposer (the interface drafters implement), NgramProposer, DraftModelProposer
    methods.py      the registry of drafter families (filled from the `hsx.drafters` entry points)
    engines.py      the engine seam: Engine (what a worker holds), EngineKind (one engine described without loading
                    it), the registry `--engine` chooses from (filled from the `hsx.engines` entry points)
    hsx_kind.py     hsx's own engine (LLM) as an engine kind, `--engine hsx`
    plugins.py      plug-ins by entry point (installed, or declared in this source tree's pyproject.toml)
    norm.py         FinalNorm: the target's final norm, found by structure (the model's own module, weights from the
                    checkpoint)
    checkpoint_files.py  weight_map, load_tensors: which safetensors file of a checkpoint folder holds a tensor
                    (index.json or the single file's header), and the named tensors read from them
    head.py         LogitsHead: final norm, lm_head and the family's logits transform, checked against the model
    topk.py         TopK: a top-k target's ids and log-probabilities from the last layer (the model's own modules)
    rollback.py     RollbackPlan: how a target's cache forgets rejected drafts (full, windowed, linear attention), or
                    the one-line refusal
    verification.py which drafted tokens the target keeps (greedy match, speculative rejection sampling)
    metrics.py      Counter / Vector shaped as vLLM's metrics reader, the speculative-decoding counters
    layers.py       layer-id semantics, the decoder layers found by structure, the capture hooks, early exit
    batching.py     token-budget batches grouped by length; packed batches (prompts end to end, best fit)
    packing.py      packed prefill: prompt-only batches as one row, attention per prompt (transformers' attention
                    interface), where a probe at load shows it exact
    chat_content.py OpenAI content parts -> a chat template's content (vLLM's "auto" rule; LLM.chat, hsx serve, corpora)
    media.py        MediaPolicy, load_images: what an image prompt may bring and how its images load (vLLM's
                    limit_mm_per_prompt, allowed_local_media_path, allowed_media_domains; decoded-size budgets;
                    local files opened without following links; no torch); which VL families run
    image_fetch.py  fetch_image: an http(s) image under one deadline, allowed hosts only, redirects only to them,
                    transient failures tried again (ImageUnavailable when they last)
    multimodal.py   vision-language targets: the processor (without torchvision), MediaPrompt, Vision (the tower,
                    M-RoPE positions, merged embeddings, Qwen3-VL's deepstack)
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EngineConfig": "extractor.config",
    "SpeculativeConfig": "extractor.config",
    "LLM": "extractor.llm",
    "CompletionOutput": "extractor.llm",
    "RequestOutput": "extractor.llm",
    "SamplingParams": "extractor.sampling",
}
"""name -> its module, loaded on first use: `import extractor.options` (the command line's) stays free of torch."""

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams", "SpeculativeConfig"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'extractor' has no attribute {name!r}")
