"""A request's state inside the engine (extractor.LLM): its prompt, sampling parameters, output so far, and how it
ended; what the scheduler, the stopping rules and the output builder share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from extractor.sampling import SamplingParams


@dataclass
class Request:
    index: int
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    loss_mask: list[int] | None = None
    sample_id: str | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_kind: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    generator: torch.Generator | None = None
    stop_reason: int | str | None = None
    stop_hit: bool = False  # a stop string ended the output: _output cuts the text there
    text: str = ""  # the output text decoded so far, for the stop-string search (requests with stop strings only)
    detok: Any = None  # the incremental decoder behind `text` (tokenizers' DecodeStream), made at the first token

    @property
    def include_output_tokens(self) -> bool:
        return bool(self.params.kv_transfer_params.get("include_output_tokens"))
