"""A request inside the engine (extractor.LLM): the checks it must pass, and its state while it runs.

    check_request(prompt_token_ids, ..., max_model_len=, vocab_size=)   the one check of a prompt and its limits
                   (empty, too long, no room to generate, ids outside the vocabulary, a loss mask of another
                   length); RequestRejected names the parameter and a code (vLLM-style, for HTTP 400s)
    RequestRejected   a ValueError with `param` and `code`
    Request        one request's state: prompt, sampling parameters, output so far, how it ended, its own
                   speculative-decoding counts
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from extractor.metrics import SpecDecodingStats
from extractor.sampling import SamplingParams


class RequestRejected(ValueError):
    """A request that cannot run as given; `param` names the field to fix, `code` the kind (e.g. prompt_too_long)."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_request(prompt_token_ids: Sequence[int], *, max_model_len: int, vocab_size: int, max_tokens: int | None,
                  max_prompt_tokens: int | None = None, limit_flags: str = "max_model_len",
                  stop_token_ids: Sequence[int] = (), loss_mask: Sequence[int] | None = None,
                  param: str = "prompt") -> int:
    """Raise RequestRejected unless the prompt can run: not empty, within `max_prompt_tokens` (default
    max_model_len; `limit_flags` names the settings that set it), room to generate `max_tokens` (None = the rest of
    max_model_len), every id in the vocabulary, one loss-mask value per token. Returns max_tokens resolved."""
    n = len(prompt_token_ids)
    limit = max_model_len if max_prompt_tokens is None else min(max_prompt_tokens, max_model_len)
    if n == 0:
        raise RequestRejected("the prompt is empty (0 tokens); nothing to extract", param, "empty_prompt")
    if n > limit:
        where = (f"max_model_len={limit}; shorten it or raise max_model_len" if max_prompt_tokens is None else
                 f"the limit of {limit} ({limit_flags}); shorten it")
        raise RequestRejected(f"the prompt has {n} tokens, more than {where}", param, "prompt_too_long")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestRejected(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})", param,
                              "invalid_token_ids")
    room = max_model_len - n
    max_tokens = room if max_tokens is None else max_tokens
    if max_tokens > 0 and room <= 0:
        raise RequestRejected(f"the prompt has {n} tokens, leaving no room to generate within max_model_len="
                              f"{max_model_len}; use max_tokens=0 (prompt only) or a shorter prompt", "max_tokens",
                              "prompt_too_long")
    if max_tokens > room:
        raise RequestRejected(f"max_tokens={max_tokens} with a {n}-token prompt exceeds max_model_len={max_model_len};"
                              f" ask for at most {room}", "max_tokens", "max_tokens_too_large")
    bad = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestRejected(f"stop_token_ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})",
                              "stop_token_ids", "invalid_token_ids")
    if loss_mask is not None and len(loss_mask) != n:
        raise RequestRejected(f"loss_mask has {len(loss_mask)} values for {n} prompt tokens; give one per token",
                              "loss_mask", "invalid_loss_mask")
    return max_tokens


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
    spec_decode: SpecDecodingStats | None = None  # this request's drafts and acceptance (speculative engines only)
    writes: bool = True  # it writes a file (connector.writes): else it only generates, nothing captured for it
    media: Any = None  # an image prompt's processed inputs (extractor.multimodal.MediaPrompt); None for text

    @property
    def include_output_tokens(self) -> bool:
        return bool(self.params.kv_transfer_params.get("include_output_tokens"))
