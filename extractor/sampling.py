"""`SamplingParams` (vLLM's names and defaults) and the sampler for the next token.

Greedy when temperature is 0; otherwise temperature, top-k and top-p, drawn from a per-request generator so a
`seed` reproduces a request's output regardless of what else is in its batch.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_GREEDY_EPS = 1e-5
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes


@dataclass
class SamplingParams:
    max_tokens: int = 16
    """Tokens to generate; 0 = prompt-only extraction with no sampling and no lm_head at all (hsx extension)."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 = off."""
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: str | list[str] | None = None
    """Stop strings: generation ends when the output text contains one; the text ends before it (unless
    include_stop_str_in_output) and token_ids end with the token that completed it, as in vLLM."""
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    extra_args: dict[str, Any] | None = None
    """{"kv_transfer_params": {"hidden_states_path": ..., "include_output_tokens": bool, "overwrite": bool}};
    overwrite=True lets a request replace a file an earlier request of the same connector wrote."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0 (0 = prompt only), got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            try:
                seed = operator.index(self.seed)  # ints and integer scalars (numpy's), not floats or bools
            except TypeError:
                seed = None
            if seed is None or isinstance(self.seed, bool) or not SEED_MIN <= seed <= SEED_MAX:
                raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (torch's generator range), "
                                 f"got {self.seed!r}")
            self.seed = seed
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(x, str) and x for x in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = stops
        params = self.kv_transfer_params
        if not isinstance(params, Mapping):
            raise TypeError(f"extra_args['kv_transfer_params'] must be a dict, got {type(params).__name__}")
        unknown = sorted(set(params) - {"hidden_states_path", "include_output_tokens", "overwrite"})
        if unknown:
            raise ValueError(f"unknown kv_transfer_params keys {unknown}; valid: hidden_states_path, "
                             "include_output_tokens, overwrite")

    @property
    def kv_transfer_params(self) -> Mapping[str, Any]:
        return (self.extra_args or {}).get("kv_transfer_params") or {}

    @property
    def sent_kv_transfer_params(self) -> Mapping[str, Any] | None:
        """The request's kv_transfer_params as sent: None when it sent none (a connector whose files are
        "requested" writes nothing for it)."""
        return (self.extra_args or {}).get("kv_transfer_params")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def make_generator(params: SamplingParams) -> torch.Generator:
    import torch  # here, not at import: a job's settings are checked without torch
    gen = torch.Generator(device="cpu")
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def sample_next(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> list[int]:
    """Pick one token per row of `logits` [B, V]."""
    import torch  # here, not at import: a job's settings are checked without torch
    if all(p.greedy for p in params):  # on the device: B ids cross to the host, not B x V logits
        return logits.argmax(-1).tolist()
    logits = logits.float().cpu()
    out: list[int] = []
    for row, p, gen in zip(logits, params, generators):
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        out.append(int(torch.multinomial(sampling_probs(row, p), 1, generator=gen)))
    return out


def sample_with_probs(logits: torch.Tensor, params: Sequence[SamplingParams],
                      generators: Sequence[torch.Generator | None]) -> tuple[list[int], list[torch.Tensor | None]]:
    """One token per row of `logits` [B, V] and the distribution it was drawn from (what a drafter hands the
    verifier as q): the argmax and None for greedy rows, a draw from sampling_probs ([V]) otherwise."""
    import torch  # here, not at import: a job's settings are checked without torch
    greedy = logits.argmax(-1).tolist()
    tokens: list[int] = []
    probs: list[torch.Tensor | None] = []
    for b, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            tokens.append(greedy[b])
            probs.append(None)
        else:
            q = sampling_probs(logits[b], p)  # [V] float32 on the CPU
            tokens.append(int(torch.multinomial(q, 1, generator=gen)))
            probs.append(q)
    return tokens, probs


def sampling_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: logits [V] -> probabilities [V] (float32, CPU) after
    temperature, top-k and top-p. Speculative sampling verifies drafts against exactly this distribution."""
    import torch  # here, not at import: a job's settings are checked without torch
    row = row.float().cpu() / p.temperature
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        row = row.scatter(0, order[drop], float("-inf"))
    return row.softmax(-1)
