"""Engine metrics as vLLM's offline reader returns them (`vllm.v1.metrics.reader`): `llm.get_metrics()`.

    Metric      name, labels
    Counter     .value  (int)
    Vector      .values (list[int])
    SpecDecodingStats   the engine's running counts; .metrics() -> [Counter | Vector]. Each request of a
                        speculative engine keeps one too (RequestOutput.spec_decode): its share of the engine's
                        counts, so the requests' counts sum to the engine's.

Names are vLLM's: vllm:prompt_tokens, vllm:generation_tokens, vllm:spec_decode_num_drafts,
vllm:spec_decode_num_draft_tokens, vllm:spec_decode_num_accepted_tokens and
vllm:spec_decode_num_accepted_tokens_per_pos (length k). Mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class SpecDecodingStats:
    """Running counts since the engine started (or of one request): one draft = one request's proposal verified in
    one step."""

    num_speculative_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafter_seconds: float = field(default=0.0, compare=False)
    """Wall time the proposer spent (propose, accepted, observe; hsx extension: hsx:spec_decode_drafter_seconds); the
    engine's only, not a request's."""
    drafter_steps: int = field(default=0, compare=False)
    """Speculative steps (one proposal for the whole batch each; hsx:spec_decode_steps); the engine's only."""

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified proposal of `num_draft_tokens` tokens whose first `num_accepted` the target accepted."""
        assert 0 <= num_accepted <= num_draft_tokens <= self.num_speculative_tokens
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def metrics(self) -> list[Metric]:
        out: list[Metric] = [Counter("vllm:prompt_tokens", {}, self.prompt_tokens),
                             Counter("vllm:generation_tokens", {}, self.generation_tokens)]
        if self.num_speculative_tokens:
            out += [Counter("vllm:spec_decode_num_drafts", {}, self.num_drafts),
                    Counter("vllm:spec_decode_num_draft_tokens", {}, self.num_draft_tokens),
                    Counter("vllm:spec_decode_num_accepted_tokens", {}, self.num_accepted_tokens),
                    Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {}, list(self.accepted_per_pos)),
                    Counter("hsx:spec_decode_drafter_seconds", {}, self.drafter_seconds),
                    Counter("hsx:spec_decode_steps", {}, self.drafter_steps)]
        return out
