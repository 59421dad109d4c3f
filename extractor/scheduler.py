"""The scheduler: which requests run in which forward, and the engine loop around it (what `LLM.generate` drives).

    Scheduler(config, runner, connector, proposer, stopping, stats, aborts).run(requests, progress)
        prompt-only requests: token-budget batches grouped by length (extractor.batching), prefill only, captured
        rows to the connector chunk by chunk; generating requests: continuous batching — up to max_num_seqs rows
        decode together (speculatively with a proposer: extractor.speculative), finished rows leave, waiting ones
        are prefilled and join. A failed forward fails its own requests, never the others.
    Aborts             the request ids abort_request named, taken by the loop at its next step (thread-safe)
    OutputRows         generated tokens' states kept on the device per request, handed to the connector in blocks
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import torch

from extractor.batch_state import BatchState, Captured, can_rearrange
from extractor.batching import (
    DEFAULT_FORWARD_COST_TOKENS,
    FORWARD_COST_TOKENS,
    first_batch_rows,
    plan_prompt_only,
)
from extractor.config import EngineConfig
from extractor.metrics import SpecDecodingStats
from extractor.proposers import Proposer
from extractor.request import Request
from extractor.runner import ModelRunner
from extractor.sampling import sample_next
from extractor.speculative import speculative_step
from extractor.stopping import Stopping

logger = logging.getLogger(__name__)


OUTPUT_BLOCK_TOKENS = 256
"""Generated tokens' states a request keeps on the device before they go to the connector as one block (one copy to
the host, one save call, one chunk for the writer to check and convert instead of one per token)."""


class OutputRows:
    """The states of generated tokens (include_output_tokens), per request, on the model's device: `add` one token's
    row each decode step; `flush` hands the rows kept so far to the connector as one block (when a request has
    `block` of them, default OUTPUT_BLOCK_TOKENS, and when it finishes); `drop` forgets a failed or aborted
    request's."""

    def __init__(self, connector, runner: ModelRunner, block: int | None = None) -> None:
        self.connector, self.runner, self.block = connector, runner, block or OUTPUT_BLOCK_TOKENS
        self._rows: dict[str, tuple[list[int], list[torch.Tensor], dict[str, list[torch.Tensor]]]] = {}

    def add(self, request_id: str, token_id: int, states: torch.Tensor, extra: dict[str, torch.Tensor]) -> None:
        tokens, chunks, extras = self._rows.setdefault(request_id, ([], [], {}))
        tokens.append(token_id)
        chunks.append(states)
        for name, t in extra.items():
            extras.setdefault(name, []).append(t)
        if len(tokens) >= self.block:
            self.flush(request_id)

    def flush(self, request_id: str) -> None:
        kept = self._rows.pop(request_id, None)
        if kept is None:
            return
        tokens, chunks, extras = kept
        host = self.runner.to_host
        self.connector.save_hidden_states(request_id, torch.tensor(tokens, dtype=torch.long),
                                          host(torch.cat(chunks)), {n: host(torch.cat(c)) for n, c in extras.items()})

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._rows.pop(rid, None)


class Aborts:
    """Requests aborted while a generate() call runs them (vLLM's abort_request), for the loop to take."""

    def __init__(self, connector) -> None:
        self._connector = connector
        self._lock = threading.Lock()
        self._aborted: set[str] = set()
        self._active: set[str] = set()  # request ids of the generate() calls running now

    def __bool__(self) -> bool:
        return bool(self._aborted)

    @contextlib.contextmanager
    def running(self, request_ids: Sequence[str]) -> Iterator[None]:
        """While a generate() call runs `request_ids`: aborts of them count; afterwards they are forgotten."""
        with self._lock:
            self._active.update(request_ids)
        try:
            yield
        finally:
            with self._lock:
                self._active.difference_update(request_ids)
                self._aborted.difference_update(request_ids)

    def request(self, request_ids: Iterable[str]) -> None:
        """Abort these (ids of no running call are ignored)."""
        with self._lock:
            self._aborted.update(i for i in map(str, request_ids) if i in self._active)

    def take(self, requests: Sequence[Request]) -> list[Request]:
        """The unfinished ones of `requests` aborted since they started, marked so and their files dropped."""
        if not self._aborted:
            return []
        with self._lock:
            hit = [r for r in requests if r.request_id in self._aborted and r.error is None and r.finish_reason is None]
            self._aborted.difference_update(r.request_id for r in hit)
        for r in hit:
            if r.writes:
                self._connector.abort_request(r.request_id)
            r.error, r.error_kind = "aborted (abort_request)", "aborted"
        return hit


class Scheduler:
    """Runs checked requests to their end on one engine's runner, connector and (optional) proposer."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, connector, proposer: Proposer | None,
                 stopping: Stopping, stats: SpecDecodingStats, aborts: Aborts) -> None:
        self.config, self.runner, self.connector, self.proposer = config, runner, connector, proposer
        self.stopping, self.stats, self.aborts = stopping, stats, aborts
        self.outputs = OutputRows(connector, runner)

    def run(self, requests: Sequence[Request], progress) -> None:
        """Every request to its end (finished, failed or aborted); `progress.update(n)` as they end."""
        try:
            self._run(requests, progress)
        finally:  # an error that escaped the loop: no generated rows stay kept on the device
            self.outputs.drop(r.request_id for r in requests)

    def _run(self, requests: Sequence[Request], progress) -> None:
        prompt_only = [r for r in requests if r.params.max_tokens == 0]
        for batch in self.plan_prompt_only(prompt_only):
            self.aborts.take(batch.items)
            live = [r for r in batch.items if r.error is None]
            if live:
                try:
                    self._run_prompt_batch(live, batch.chunk_size, batch.packed and len(live) > 1)
                except Exception as e:  # fails the batch's requests, not the others
                    self._fail(live, e)
            progress.update(len(batch.items))
        self._run_generating([r for r in requests if r.params.max_tokens > 0], progress)

    def plan_prompt_only(self, items: Sequence, length=lambda r: len(r.prompt_token_ids)) -> list:
        """The forwards of prompt-only requests (or any items, with their `length`): packed end to end where the runner
        packs (text prompts; none as long as the packer's max_prompt_tokens), padded batches grouped by length
        otherwise (extractor.batching)."""
        packer = self.runner.packer
        return plan_prompt_only(items, length, self.config.max_num_batched_tokens, self.config.max_num_seqs,
                                packed=packer is not None, device_type=self.runner.device.type,
                                packed_limit=None if packer is None else packer.max_prompt_tokens)

    def _fail(self, requests: Sequence[Request], e: Exception) -> None:
        """Fail the unfinished ones of `requests` after an exception in their forward (finished ones are written)."""
        logger.error("a forward of %d requests failed: %s: %s", len(requests), type(e).__name__, e,
                     exc_info=(type(e), e, e.__traceback__))
        for r in requests:
            if r.finish_reason is None and r.error is None:
                self.outputs.drop([r.request_id])
                if r.writes:
                    self.connector.abort_request(r.request_id)
                r.error, r.error_kind = f"{type(e).__name__}: {e}", "engine"

    def _prefill(self, batch: list[Request], chunk_size: int, generating: bool, packed: bool = False
                 ) -> tuple[torch.Tensor | None, BatchState | None, list[torch.Tensor] | None]:
        """Prefill `batch`: captured prompt states go to the connector (extraction) or, for a proposer that reads
        target states, are returned per row ([T_b, L, H] on the device)."""
        observe = self.proposer is not None and bool(self.proposer.capture_layer_ids)
        parts: list[list[torch.Tensor]] = [[] for _ in batch]

        def on_chunk(c0: int, c1: int, captured: Captured | None, starts: list[int]) -> None:
            if captured is None:  # captured.states: [B, c1 - c0, L, H]
                return
            for b, r in enumerate(batch):
                start, end = starts[b], starts[b] + len(r.prompt_token_ids)  # row b's columns
                lo, hi = max(c0, start), min(c1, end)
                if lo >= hi:
                    continue
                states, extra = captured.row(b, lo - c0, hi - c0)
                if observe:
                    parts[b].append(states)
                elif r.writes:
                    ids = torch.tensor(r.prompt_token_ids[lo - start:hi - start], dtype=torch.long)
                    self.connector.save_hidden_states(r.request_id, ids, states, extra)

        rows = [r.prompt_token_ids for r in batch]
        logits, state = self.runner.prefill(rows, chunk_size, want_logits=generating, keep_cache=generating,
                                            on_chunk=on_chunk, to_host=not observe,
                                            capture=observe or any(r.writes for r in batch),
                                            media=[r.media for r in batch], packed=packed)
        return logits, state, ([torch.cat(p) for p in parts] if observe else None)

    def _run_prompt_batch(self, batch: list[Request], chunk_size: int, packed: bool) -> None:
        if any(r.writes for r in batch):  # prompt-only requests that write no file need no forward at all
            self._prefill(batch, chunk_size, generating=False, packed=packed)
        for r in batch:
            r.finish_reason = "length"
            r.kv_transfer_params = self.connector.request_finished(r.request_id) if r.writes else None

    def _run_generating(self, requests: list[Request], progress) -> None:
        """Continuous batching: up to max_num_seqs requests decode together (speculatively with a proposer); when
        rows finish, waiting requests are prefilled (longest first, under max_num_batched_tokens) and join the
        running batch. A cache that cannot be rearranged (sliding-window layers) runs each batch to its end."""
        waiting = deque(sorted(requests, key=lambda r: len(r.prompt_token_ids), reverse=True))
        running: list[Request] = []
        state: BatchState | None = None
        while waiting or running:
            if self.aborts:
                gone = self.aborts.take(list(waiting) + running)
                self.outputs.drop(r.request_id for r in gone)
                if gone:
                    progress.update(len(gone))
                    waiting = deque(r for r in waiting if r.error is None)
                    keep = [i for i, r in enumerate(running) if r.error is None]
                    if len(keep) < len(running):
                        running, state = self._keep_rows(running, state, keep)
            if waiting and len(running) < self.config.max_num_seqs and \
                    (state is None or (can_rearrange(state.cache) and
                                       (self.proposer is None or self.proposer.can_join()))):
                group, chunk = self._admissible(waiting, self.config.max_num_seqs - len(running))
                try:
                    joined, new_state = self._admit(group, chunk, running)
                except Exception as e:  # fails the group, not the running rows
                    self._fail(group, e)
                    joined, new_state = [], None
                progress.update(len(group) - len(joined))
                if joined:
                    if state is None:
                        state = new_state
                    else:
                        state.merge(new_state)
                    running.extend(joined)
            if not running:
                continue
            try:
                self._step(running, state)
            except Exception as e:  # the running rows' caches are in an unknown state: fail them all
                self._fail(running, e)
                progress.update(len(running))
                running, state = [], None
                continue
            keep = [i for i, r in enumerate(running) if r.finish_reason is None]
            if len(keep) < len(running):
                progress.update(len(running) - len(keep))
                running, state = self._keep_rows(running, state, keep)
            if state is not None:
                state.maybe_compact()

    def _keep_rows(self, running: list[Request], state: BatchState, keep: list[int]
                   ) -> tuple[list[Request], BatchState | None]:
        """Only rows `keep` of the running batch continue (in the cache and the proposer too)."""
        if not keep:
            return [], None
        state.select(keep)
        if self.proposer is not None:
            self.proposer.select(keep)
        return [running[i] for i in keep], state

    @property
    def _forward_cost_tokens(self) -> int:
        """One forward's fixed cost in tokens' worth of work on this device (batching.FORWARD_COST_TOKENS)."""
        return FORWARD_COST_TOKENS.get(self.runner.device.type, DEFAULT_FORWARD_COST_TOKENS)

    def _admissible(self, waiting: deque, free: int) -> tuple[list[Request], int]:
        """Pop the next prefill group: the longest waiting requests, at most `free`, padded to the first (longest)
        within max_num_batched_tokens, cut where padding the rest to the longest costs more than another forward
        (batching.first_batch_rows); a prompt over the budget goes alone, prefilled in chunks of the budget."""
        budget = self.config.max_num_batched_tokens
        longest = len(waiting[0].prompt_token_ids)
        lengths = [len(r.prompt_token_ids) for r in itertools.islice(waiting, min(free, len(waiting)))]
        n = max(1, first_batch_rows(lengths, budget, free, self._forward_cost_tokens))
        return [waiting.popleft() for _ in range(n)], min(longest, budget)

    def _admit(self, group: list[Request], chunk_size: int, running: list[Request]
               ) -> tuple[list[Request], BatchState | None]:
        """Prefill `group`, sample each row's first token; the rows still unfinished, with their cache."""
        logits, state, states = self._prefill(group, chunk_size, generating=True)
        first = sample_next(logits, [r.params for r in group], [r.generator for r in group])
        keep = [i for i, (r, t) in enumerate(zip(group, first)) if not self._emit(r, [t])]
        if not keep:
            return [], None
        if len(keep) < len(group):
            state.select(keep)
        joined = [group[i] for i in keep]
        if self.proposer is not None:
            contexts = [r.prompt_token_ids + r.output_ids for r in joined]
            if running:
                self.proposer.join(contexts)
            else:
                self.proposer.start(contexts)
            if any(r.media is not None for r in joined):
                self.proposer.media([r.media for r in joined])
            if states is not None:
                empty = states[0][:0]
                self.proposer.observe([empty] * len(running) + [states[i] for i in keep])
        return joined, state

    def _step(self, active: list[Request], state: BatchState) -> None:
        """One decode step of the running rows: one token each, or (with a proposer) a verified draft each."""
        if self.proposer is not None:
            speculative_step(active, state, self.runner, self.proposer, self.config.speculative.num_speculative_tokens,
                             self.stopping, self.stats, self._emit)
            return
        capture = any(r.include_output_tokens and r.writes for r in active)
        logits, captured = self.runner.decode(state, [r.output_ids[-1] for r in active], capture, to_host=False)
        if capture:
            keep = [b for b, r in enumerate(active) if r.include_output_tokens and r.writes]
            kept = captured.take_rows(keep)  # only the writers' rows stay alive on the device until their flush
            for i, b in enumerate(keep):  # row i: [1, L, H], the token just fed
                self.outputs.add(active[b].request_id, active[b].output_ids[-1], *kept.row(i, 0, 1))
        tokens = sample_next(logits, [r.params for r in active], [r.generator for r in active])
        for r, t in zip(active, tokens):
            self._emit(r, [t])

    def _emit(self, r: Request, tokens: list[int]) -> bool:
        """Append tokens to r's output one by one, stopping at the first that finishes it; True when finished."""
        for t in tokens:
            r.output_ids.append(t)
            reason = self.stopping.finish_reason(r, t)
            if reason is not None:
                if r.writes:  # first: a failure here fails the request (unfinished), never answers it without its file
                    self.outputs.flush(r.request_id)
                    r.kv_transfer_params = self.connector.request_finished(r.request_id)
                r.finish_reason = reason
                return True
        return False
