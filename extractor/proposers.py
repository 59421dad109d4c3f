"""Proposers: what drafts tokens for speculative decoding. The target verifies them (extractor/verification.py).

A proposer serves one batch of requests at a time, its rows in the engine's row order. The engine's speculative loop
calls, per batch:

    start(contexts)                       - a new batch; contexts[b] = prompt + output so far         (default: nothing)
    join(contexts)                        - rows appended after the current ones (continuous batching) (default: nothing)
    observe(states)                       - target states of the tokens verified since the last call   (default: nothing)
    propose(contexts, ks, params, gens)   - up to ks[b] tokens per row, optionally with their probabilities  (abstract)
    accepted(num_accepted)                - feedback: how many of each row's last draft the target kept (default: nothing)
    select(keep)                          - the rows that continue, the others finished               (default: nothing)

Order per step: propose -> accepted -> observe -> select. After start / join the engine calls observe with the rows'
prompt states, then propose. Only a proposer with `capture_layer_ids` gets observe calls; the engine captures those
target layers (vLLM ids, extractor/layers.py: N = the last decoder layer, pre-norm) in the prefill and in every
verification forward. Invariant: once observe returns, the proposer has been handed the states of exactly
contexts[b][:-1] for every row, i.e. every token but the newest, whose state the target has not computed yet
(the target computes it when it verifies the next draft).

    NgramProposer        prompt lookup: the continuation of the longest suffix n-gram seen earlier in the context
    DraftModelProposer   a smaller HF causal LM with the target's vocabulary, its own KV cache rolled back on rejection
    make_proposer(config, runner)   the proposer a SpeculativeConfig names (a trained head's: the drafter family's
                                    proposer, found through the registry, extractor/methods.py)

A new drafter family is one more Proposer subclass (drafters/NAME_proposer.py, found through the registry); the
verification loop does not change.
"""

from __future__ import annotations

import inspect
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from extractor.batch_state import BatchState, can_rearrange, forward_rows
from extractor.config import SpeculativeConfig
from extractor.methods import family
from extractor.rollback import rollback_plan
from extractor.sampling import SamplingParams, sample_with_probs

logger = logging.getLogger(__name__)


@dataclass
class Draft:
    token_ids: list[int]
    """Proposed tokens, at most the k the engine asked for; empty = no proposal (a plain decode step)."""
    probs: torch.Tensor | None = None
    """[len(token_ids), V] the proposer's distribution q each token was drawn from; None = deterministic (one-hot q).
    Only read for requests with temperature > 0."""


class Proposer(ABC):
    """Drafts tokens for the active rows of one batch (see the module docstring for the call order)."""

    def start(self, contexts: Sequence[list[int]]) -> None:  # noqa: B027 - optional hook
        """A new batch begins; contexts[b] = row b's prompt + output so far."""

    @abstractmethod
    def propose(self, contexts: Sequence[list[int]], ks: Sequence[int], params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[Draft]:
        """At most ks[b] tokens (ks[b] may be 0) continuing contexts[b], one Draft per row. Sampling proposers draw
        from `generators[b]` for rows with temperature > 0 and return the probabilities they drew from."""

    capture_layer_ids: tuple[int, ...] = ()
    """Target layer ids whose states this proposer reads (EAGLE-3: its aux layers; Medusa, MLPSpeculator: the last
    layer N, pre-norm, to which they apply the target's final norm). Empty = no observe calls, nothing captured."""

    def join(self, contexts: Sequence[list[int]]) -> None:  # noqa: B027 - optional hook
        """Rows appended after the current ones (continuous batching); contexts as in start()."""

    def can_join(self) -> bool:
        """Whether join() can add rows now (False: the engine runs the current rows to their end first)."""
        return True

    def media(self, rows: Sequence) -> None:  # noqa: B027 - optional hook
        """The image prompts (extractor.multimodal.MediaPrompt, None for text) of the rows start/join just added, in
        their order. Default: nothing (a proposer that never embeds the prompt's tokens: ngram, a draft model on
        token ids, heads on the target's states); EAGLE-family proposers feed the vision embeddings at image tokens."""

    def observe(self, states: Sequence[torch.Tensor]) -> None:  # noqa: B027 - optional hook
        """states[b]: [n_b, len(capture_layer_ids), H] (engine device and dtype) the target's states of row b's
        tokens verified since the last call, in order (n_b may be 0): after start/join the whole prompt; after a
        verification the previously newest token and the accepted drafts (1 + num_accepted[b] tokens)."""

    def accepted(self, num_accepted: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """The target kept the first num_accepted[b] tokens of row b's last draft, then one token of its own."""

    def select(self, keep: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """Only rows `keep` (indices into the current rows) continue."""


class NgramProposer(Proposer):
    """Prompt lookup decoding: for n from prompt_lookup_max down to prompt_lookup_min, find the most recent earlier
    occurrence of the context's last n tokens and propose the (up to k) tokens that followed it."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, contexts, ks, params, generators) -> list[Draft]:
        return [Draft(self._lookup(ctx, k)) for ctx, k in zip(contexts, ks)]

    def _lookup(self, ctx: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
            suffix = ctx[-n:]
            for i in range(len(ctx) - n - 1, -1, -1):  # i = len - n would be the suffix itself
                if ctx[i:i + n] == suffix:
                    return ctx[i + n:i + n + k]
        return []


class DraftModelProposer(Proposer):
    """A smaller causal LM drafts k tokens autoregressively (greedy rows: argmax; sampled rows: the request's own
    temperature/top-k/top-p). Its cache holds what it was fed; rejected drafts are masked out of it (rollback)."""

    def __init__(self, model_dir: str, target) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.from_pretrained(model_dir)
        if getattr(hf_config, "is_encoder_decoder", False):
            raise ValueError(f"draft model {model_dir} is an encoder-decoder model; a draft must be a causal LM")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=target.dtype).to(target.device).eval()
        self.model.requires_grad_(False)
        if rollback_plan(self.model, target.max_model_len).even:
            raise ValueError(f"draft model {model_dir}: its cache holds sliding-window or linear-attention layers, "
                             "which hsx does not roll back in a draft model; use a draft with full attention only")
        vocab = self.model.get_input_embeddings().num_embeddings
        out_vocab = self.model.get_output_embeddings().out_features
        if vocab != target.vocab_size or out_vocab != target.vocab_size:
            raise ValueError(f"draft model {model_dir} has a vocabulary of {out_vocab} tokens, the target "
                             f"{target.config.model} has {target.vocab_size}: draft_model needs a draft with the "
                             "target's tokenizer and vocabulary (e.g. a smaller model of the same family)")
        _check_same_tokens(model_dir, target)
        self.pad_id, self.device = target.pad_id, target.device
        self.budget = target.config.max_num_batched_tokens  # tokens per prefill forward, as the target's
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self._state = None
        self._fed: list[int] = []  # row b's tokens in the draft cache
        self._drafted = 0  # drafts of the last propose() fed to the cache beyond the context (K - 1)

    def start(self, contexts) -> None:
        self._state = None
        self._fed = []
        self._drafted = 0
        self.join(contexts)

    def can_join(self) -> bool:
        return self._state is None or can_rearrange(self._state.cache)

    @torch.inference_mode()
    def join(self, contexts) -> None:
        """Prefill the new rows' contexts but their newest token (fed with the next propose) and append them, in
        forwards of at most the engine's max_num_batched_tokens (the rows right-aligned, cut into column chunks)."""
        from transformers import DynamicCache

        b = len(contexts)
        new = BatchState(DynamicCache(config=self.model.config),
                         torch.zeros((b, 0), dtype=torch.long, device=self.device),
                         torch.zeros(b, dtype=torch.long, device=self.device))
        rows = [list(ctx[:-1]) for ctx in contexts]
        width = max(len(r) for r in rows)
        step = max(1, self.budget // b)
        for end in range(width % step or step, width + 1, step):  # the last chunk ends at the last column
            pieces = [r[max(0, len(r) - width + end - step):max(0, len(r) - width + end)] for r in rows]
            forward_rows(self.model, new, pieces, self.pad_id, self._cache_kw, last=1)
        if self._state is None:
            self._state = new
        else:
            self._state.merge(new)
        self._fed += [len(ctx) - 1 for ctx in contexts]

    @torch.inference_mode()
    def propose(self, contexts, ks, params, generators) -> list[Draft]:
        k_max = max(ks, default=0)
        if k_max == 0:
            return [Draft([]) for _ in contexts]
        kw = self._cache_kw
        pending = [ctx[fed:] for ctx, fed in zip(contexts, self._fed)]  # >= 1 token each: the newest is never fed
        logits = forward_rows(self.model, self._state, pending, self.pad_id, kw, last=1)[:, -1]  # [B, V]
        self._fed = [len(ctx) for ctx in contexts]
        tokens: list[list[int]] = [[] for _ in contexts]
        probs: list[list[torch.Tensor]] = [[] for _ in contexts]
        for step in range(k_max):
            for b, (t, q) in enumerate(zip(*sample_with_probs(logits, params, generators))):
                tokens[b].append(t)
                if q is not None:
                    probs[b].append(q)
            if step < k_max - 1:
                logits = forward_rows(self.model, self._state, [[t[-1]] for t in tokens], self.pad_id, kw,
                                      last=1)[:, -1]
        self._drafted = k_max - 1
        return [Draft(t[:k], torch.stack(q[:k]) if q and k else None) for t, q, k in zip(tokens, probs, ks)]

    def accepted(self, num_accepted) -> None:
        for b, a in enumerate(num_accepted):
            kept = min(a, self._drafted)  # the cache holds the first K - 1 drafts; keep the accepted ones
            self._state.rollback(b, self._drafted - kept)
            self._fed[b] += kept
        self._drafted = 0
        self._state.maybe_compact()

    def select(self, keep) -> None:
        self._state.select(list(keep))
        self._fed = [self._fed[i] for i in keep]


def _check_same_tokens(model_dir: str, target) -> None:
    """A draft that ships a tokenizer must map every token string to the target's id (same size is not enough)."""
    import os

    if not any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return
    from transformers import AutoTokenizer

    mine, theirs = AutoTokenizer.from_pretrained(model_dir).get_vocab(), target.tokenizer.get_vocab()
    if mine != theirs:
        differ = sorted((set(mine.items()) ^ set(theirs.items())), key=lambda kv: kv[1])[:3]
        raise ValueError(f"draft model {model_dir} has a tokenizer whose vocabulary differs from the target "
                         f"{target.config.model}'s (e.g. {differ}): draft_model needs the target's tokenizer; use a "
                         "draft of the same family, or remove the draft's tokenizer files if its ids are the target's")


def make_proposer(config: SpeculativeConfig, runner) -> Proposer:
    """The proposer `config.method` names, for the target loaded in `runner`."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        return DraftModelProposer(config.model, runner)
    found = family(config.method)  # trained heads: the drafter registry (extractor/methods.py)
    if found is not None:
        return found.proposer(config.model, runner, config.num_speculative_tokens)
    raise ValueError(f"no proposer for speculative method {config.method!r}")  # SpeculativeConfig checks first
