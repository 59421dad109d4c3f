"""What an evaluation of drafters finds, per method: the counters, the comparison with the reference, the result.

    SpecDecodeCounts                      vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens,
                                          accepted per position) and hsx's drafter time; + and - field by field
    spec_decode_counts(metrics)           those counters summed from llm.get_metrics() (or from one request's
                                          RequestOutput.spec_decode.metrics())
    check_lossless(reference, outputs, name) -> [Mismatch]   each prompt whose output differs, at its first token
    LossyOutputError                      greedy speculation produced other tokens than plain decoding
    EvalResult                            one method's figures over the prompts (AL, acceptance per position, tokens
                                          per target step, tokens/s, ...); to_dict() is results.json's entry

training/evaluate.py makes them (evaluate_speculation) and prints them; training/acceptance.py writes them to files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
_DRAFTER = {"hsx:spec_decode_drafter_seconds": "drafter_seconds", "hsx:spec_decode_steps": "drafter_steps"}


@dataclass
class SpecDecodeCounts:
    """vLLM's speculative-decoding counters (sums over get_metrics())."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafter_seconds: float = field(default=0.0, compare=False)
    """hsx's: the proposer's wall time (propose + its bookkeeping) over the speculative steps (a time: not compared)."""
    drafter_steps: int = 0

    def __add__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        return self._combine(other, 1)

    def __sub__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        return self._combine(other, -1)

    def _combine(self, other: SpecDecodeCounts, sign: int) -> SpecDecodeCounts:
        """self + sign * other, field by field (positions past either vector's end count 0)."""
        a, b = self.accepted_per_pos, other.accepted_per_pos
        pos = [(a[i] if i < len(a) else 0) + sign * (b[i] if i < len(b) else 0) for i in range(max(len(a), len(b)))]
        return SpecDecodeCounts(self.num_drafts + sign * other.num_drafts,
                                self.num_draft_tokens + sign * other.num_draft_tokens,
                                self.num_accepted_tokens + sign * other.num_accepted_tokens, pos,
                                self.drafter_seconds + sign * other.drafter_seconds,
                                self.drafter_steps + sign * other.drafter_steps)

    @property
    def drafter_ms_per_step(self) -> float | None:
        """Milliseconds the drafter took per speculative step (one step drafts for every running row)."""
        return 1000 * self.drafter_seconds / self.drafter_steps if self.drafter_steps else None

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.accepted_per_pos]


def spec_decode_counts(metrics) -> SpecDecodeCounts:
    """Sum vLLM's spec_decode counters (Counter `.value`) and the per-position vector (Vector `.values`)."""
    out = SpecDecodeCounts()
    for m in metrics:
        if m.name in _COUNTERS:
            setattr(out, _COUNTERS[m.name], getattr(out, _COUNTERS[m.name]) + int(m.value))
        elif m.name in _DRAFTER:
            setattr(out, _DRAFTER[m.name], getattr(out, _DRAFTER[m.name]) + m.value)
        elif m.name == _PER_POS:
            values = list(m.values)
            if len(out.accepted_per_pos) < len(values):
                out.accepted_per_pos += [0] * (len(values) - len(out.accepted_per_pos))
            for i, v in enumerate(values):
                out.accepted_per_pos[i] += int(v)
    return out


@dataclass(frozen=True)
class Mismatch:
    """One prompt whose output differs from the reference."""

    prompt_index: int
    position: int
    """First differing output position (or the shorter length when one output is a prefix of the other)."""
    expected: int | None
    got: int | None

    def __str__(self) -> str:
        return (f"prompt {self.prompt_index}: output token {self.position} is {self.got} where the reference has "
                f"{self.expected}")


class LossyOutputError(AssertionError):
    """Greedy speculative decoding produced tokens plain greedy decoding does not: the engine or proposer is wrong."""

    def __init__(self, message: str, results: list[EvalResult]) -> None:
        super().__init__(message)
        self.results = results


def check_lossless(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], name: str = "method"
                   ) -> list[Mismatch]:
    """Every prompt's output token ids equal to the reference's; the mismatches, each at its first differing token."""
    if len(reference) != len(outputs):
        raise ValueError(f"{name}: {len(outputs)} outputs for {len(reference)} reference outputs")
    mismatches = []
    for i, (ref, got) in enumerate(zip(reference, outputs)):
        ref, got = list(ref), list(got)
        if ref == got:
            continue
        pos = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        mismatches.append(Mismatch(i, pos, ref[pos] if pos < len(ref) else None, got[pos] if pos < len(got) else None))
    return mismatches


@dataclass
class EvalResult:
    """One method's figures over the evaluation prompts."""

    method: str
    speculative_config: dict[str, Any] | None
    num_prompts: int = 0
    max_num_seqs: int = 0
    """The engine's max_num_seqs (1: one request at a time; 0: the engine's default, every prompt at once)."""
    num_output_tokens: int = 0
    """Tokens generated over all prompts in one timed call."""
    seconds: float = 0.0
    """Median wall time of one timed generate() over all prompts."""
    counts: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    """Counters over the timed calls (warm-up excluded)."""
    timed_calls: int = 0
    """generate() calls the counters cover."""
    category_counts: dict[str, SpecDecodeCounts] = field(default_factory=dict)
    """The counters per prompt category over the same timed calls, from each request's own counts; in the order
    the categories first appear; empty when no prompt has a category, or for plain decoding."""
    token_ids: list[list[int]] = field(default_factory=list, repr=False)
    """Each prompt's output token ids."""
    mismatches: list[Mismatch] = field(default_factory=list)
    """Prompts whose output differs from the reference (empty = lossless)."""
    speedup: float | None = None
    """tokens/s over the plain-decoding method's tokens/s."""
    error: str | None = None
    """Why the method could not run (only with errors="record"); no figures then."""

    @property
    def speculative(self) -> bool:
        return self.speculative_config is not None

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_acceptance_length(self) -> float | None:
        return self.counts.mean_acceptance_length if self.speculative and not self.error else None

    @property
    def acceptance_per_position(self) -> list[float]:
        return self.counts.acceptance_per_position if self.speculative else []

    @property
    def _decode_tokens(self) -> int:
        """Tokens the timed calls decoded after each prompt's prefill (whose forward gives the first token)."""
        return self.timed_calls * max(0, self.num_output_tokens - self.num_prompts)

    @property
    def target_steps(self) -> int:
        """Target forwards after the prefills over the timed calls, per request: each gives one token plus the
        drafts it accepted."""
        return self._decode_tokens - (self.counts.num_accepted_tokens if self.speculative else 0)

    @property
    def _speculative_steps(self) -> int | None:
        """target_steps of a speculative method that ran and stepped; None otherwise (no per-step figures)."""
        steps = self.target_steps
        return steps if self.speculative and not self.error and steps > 0 else None

    @property
    def tokens_per_target_step(self) -> float | None:
        """Output tokens per target forward over every step, drafted or not. vLLM's mean acceptance length counts
        only the steps that had a draft: a method that drafts rarely (ngram without a match) can have a high AL and
        still save few forwards; this figure is what speculation saves."""
        steps = self._speculative_steps
        return self._decode_tokens / steps if steps else None

    @property
    def drafter_ms_per_step(self) -> float | None:
        """Milliseconds the drafter took per speculative step (hsx's engine times propose, accepted and observe)."""
        return self.counts.drafter_ms_per_step if self.speculative and not self.error else None

    @property
    def drafted_fraction(self) -> float | None:
        """Share of target steps that verified a draft."""
        steps = self._speculative_steps
        return self.counts.num_drafts / steps if steps else None

    @property
    def lossless(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "speculative_config": self.speculative_config, "error": self.error,
                "num_prompts": self.num_prompts, "max_num_seqs": self.max_num_seqs,
                "num_output_tokens": self.num_output_tokens,
                "seconds": self.seconds, "tokens_per_s": self.tokens_per_s, "speedup": self.speedup,
                "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_per_position": self.acceptance_per_position,
                "tokens_per_target_step": self.tokens_per_target_step, "drafted_fraction": self.drafted_fraction,
                "drafter_ms_per_step": self.drafter_ms_per_step,
                "timed_calls": self.timed_calls, "num_drafts": self.counts.num_drafts,
                "num_draft_tokens": self.counts.num_draft_tokens,
                "num_accepted_tokens": self.counts.num_accepted_tokens,
                "categories": {name: {"num_drafts": c.num_drafts, "num_draft_tokens": c.num_draft_tokens,
                                      "num_accepted_tokens": c.num_accepted_tokens,
                                      "mean_acceptance_length": c.mean_acceptance_length,
                                      "acceptance_per_position": c.acceptance_per_position}
                               for name, c in self.category_counts.items()},
                "lossless": self.lossless, "mismatches": [str(m) for m in self.mismatches[:10]]}
