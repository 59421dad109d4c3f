"""One speculative decoding step over the running rows (what the scheduler runs each step when a proposer drafts).

    speculative_step(active, state, runner, proposer, k, stopping, stats, emit)
        each row gets one proposal of up to k tokens (never past its max_tokens / max_model_len), one target forward
        over last token + drafts verifies every row's drafts together (extractor.verification: greedy match or
        rejection sampling; rows keep different numbers), the rejected positions are rolled back in the target's
        cache, the proposer is told what was kept (and given the kept rows' states when it reads them), and the
        acceptance counters grow (vLLM's spec_decode metrics), the engine's and each request's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from extractor.batch_state import BatchState
from extractor.metrics import SpecDecodingStats
from extractor.proposers import Proposer
from extractor.request import Request
from extractor.runner import ModelRunner
from extractor.stopping import Stopping
from extractor.verification import verify


def speculative_step(active: list[Request], state: BatchState, runner: ModelRunner, proposer: Proposer, k: int,
                     stopping: Stopping, stats: SpecDecodingStats, emit: Callable[[Request, list[int]], bool]) -> None:
    """One speculative step: one proposal per row, one target forward verifying all rows' drafts together (rows
    keep different numbers), the rejected positions rolled back, the proposer told what was kept. `emit(r, tokens)`
    appends a row's kept tokens (stopping at the first that finishes it)."""
    contexts = [r.prompt_token_ids + r.output_ids for r in active]
    # never draft past max_tokens / max_model_len: the step emits drafts + 1 target token
    ks = [min(k, stopping.room(r) - 1) for r in active]
    plan = runner.rollback
    if plan is not None and plan.even:  # throw-away drafts pad every row to the widest: none may pass max_model_len
        cap = min(stopping.max_model_len - len(c) for c in contexts)  # drafts the fullest row's positions allow
        ks = [min(kb, cap) for kb in ks]
    t0 = _clock(runner)
    drafts = proposer.propose(contexts, ks, [r.params for r in active], [r.generator for r in active])
    stats.drafter_seconds += _clock(runner) - t0
    stats.drafter_steps += 1
    if len(drafts) != len(active) or any(len(d.token_ids) > kb for d, kb in zip(drafts, ks)):
        raise RuntimeError(f"the proposer returned {len(drafts)} drafts of lengths "
                           f"{[len(d.token_ids) for d in drafts]} for {len(active)} rows allowed {ks}")
    rows = [[r.output_ids[-1]] + d.token_ids for r, d in zip(active, drafts)]
    if plan is not None and plan.even:  # every row as wide: throw-away drafts after the real ones, never verified
        rows = [row + [runner.pad_id] * (max(map(len, rows)) - len(row)) for row in rows]
    observe = bool(proposer.capture_layer_ids)
    width = max(map(len, rows))
    if plan is not None:
        plan.begin(state.cache, width)
    # [B, W, V] (and [B, W, L, H]); row b's tokens in its last columns
    target_logits, target_states = runner.extend(state, rows, capture=observe)
    accepted, kept_states, removed = [], [], []
    for b, (r, d) in enumerate(zip(active, drafts)):
        n, start = len(d.token_ids), width - len(rows[b])  # row b: last token + n drafts (+ throw-aways) from start
        tokens, a = verify(target_logits[b, start:start + n + 1], d, r.params, r.generator)
        stats.observe_draft(n, a)
        if r.spec_decode is not None:  # the same counts per request (RequestOutput.spec_decode)
            r.spec_decode.observe_draft(n, a)
        removed.append(len(rows[b]) - 1 - a)  # the target cache holds the whole row; keep last + a
        state.rollback(b, removed[-1])
        accepted.append(a)
        if observe:  # the states of the last token and the a accepted drafts
            kept_states.append(target_states[b, start:start + 1 + a])
        emit(r, tokens)
    if plan is not None:
        plan.undo(state.cache, width, removed)
        if plan.compact and any(removed):
            state.compact()
    t0 = _clock(runner)
    proposer.accepted(accepted)
    if observe:
        proposer.observe(kept_states)
    stats.drafter_seconds += _clock(runner) - t0  # the drafter's bookkeeping (its cache, its context) counts too


def _clock(runner: ModelRunner) -> float:
    """perf_counter once the device's queued work is done (on CUDA, kernels run after the call that queued them:
    without the sync, a proposer's work would be charged to whatever waits for it next)."""
    device = torch.device(runner.device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
