"""How hidden states are stored: the model dtype, bfloat16, float16, or float8_e4m3fn with one float32 scale per token
and layer — and the one pass over a sample's states that finds what must never be committed (NaN, Inf, a layer that
is all zeros).

    FP8_MAX, FP8_RELATIVE_ERROR         e4m3's largest value; the largest rounding error it leaves
    row_magnitudes(states)              [t, L, H] -> [t, L]: each row's largest |value| (NaN / inf where it holds one),
                                        the one pass both the check and fp8's scales read
    quantize(states, storage_dtype, magnitudes=None)
                                        [t, L, H] -> (stored [t, L, H], scales [t, L, 1] float32 or None)
    dequantize(stored, scales, dtype)   the inverse: stored.to(dtype) * scales.to(dtype) (scales None: a cast)
    BadStates                           what the connector raises for such a sample (nothing is written)
    state_problem(chunks, layer_ids, token_ids, logprobs, magnitudes=None)
                                        "non-finite value (nan) at token 3, layer 1 (hidden-state id 16)", "layer 2
                                        (...) is all zeros over all T tokens" (of distinct tokens), a non-finite
                                        target log-probability, or None
    StateChecker(layer_ids)             the same pass fed chunk by chunk (a long request's spool): feed(), finish()

fp8 follows speculators' FP8 transfer (REFERENCE.md): scale = amax / 448 (e4m3's largest value) over the hidden
dimension, clamped at 1e-12, value = fp8 * scale. hsx keeps one scale per token **and layer** ([T, L, 1]): the
pre-norm last layer's magnitude is far larger than the aux layers', and one shared scale per token would spend their
range on it. Files with one scale per token ([T, 1, 1], speculators') read the same way (the scales broadcast).
The storage dtypes' names (MODEL, FP8, STORAGE_DTYPES, check_storage_dtype) are `connectors.format`'s: a spec and
the command line check them without torch.

Priced per byte (issue 46, benchmarks/bench_host_path.py): a row's magnitude is read from the bits (the sign masked
off, IEEE magnitudes order as integers and NaN above inf), one integer pass in cache-sized blocks instead of a float
pass per question (finite? zero? amax?); fp8's division runs block by block in a reused float32 buffer. Both give
exactly what the whole-tensor float expressions gave (files byte-identical; tests/connectors/test_quant.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from connectors.format import MODEL, is_scaled


class BadStates(ValueError):
    """A sample's states must not be committed (NaN, Inf, a layer of zeros); the request fails, nothing is written."""


def write_failure(error: BaseException) -> tuple[str, str]:
    """(error kind, message) of a request whose file a writer did not commit: "bad_states" for BadStates, else
    "write_failed" (the kinds of extractor.llm.RequestOutput.error_kind; the vLLM plug-in reports the same)."""
    if isinstance(error, BadStates):
        return "bad_states", f"hidden states not committed: {error}"
    return "write_failed", f"hidden states were not saved: {type(error).__name__}: {error}"


FP8_MAX = 448.0
"""The largest finite float8_e4m3fn value."""
FP8_RELATIVE_ERROR = 16.0 / FP8_MAX
"""The largest rounding error of an fp8-stored value relative to its row's largest magnitude (half e4m3's spacing,
32, in its top binade [256, 448], over 448)."""
SCALE_FLOOR = 1e-12
"""Smallest scale (speculators' clamp): an all-zero row quantizes to zeros, never to NaN."""


ROW_MAGNITUDES = "row_magnitudes"
"""The name under which rows quantized on the device carry their `row_magnitudes` [t, L] (model dtype) to the
connector, beside HIDDEN_STATES_SCALES: what its state check reads (never stored in a file)."""

_BLOCK_BYTES = 1 << 21
"""States per pass of the blocked loops (2 MiB): their temporaries stay in cache."""
_MAGNITUDE_BITS = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
                   torch.float32: (torch.int32, 0x7FFFFFFF)}
"""dtype -> (the integer view, the mask that drops the sign bit)."""


def _block_rows(states: torch.Tensor, itemsize: int) -> int:
    """Tokens per block: about _BLOCK_BYTES of one token's rows at `itemsize` bytes a value."""
    per_token = max(1, states[0].numel() * itemsize) if states.shape[0] else 1
    return max(1, _BLOCK_BYTES // per_token)


def row_magnitudes(states: torch.Tensor) -> torch.Tensor:
    """[t, L]: the largest |value| over the hidden dimension of each token's layer, in the states' dtype, exactly;
    NaN where the row holds a NaN, else inf where it holds an inf (what float abs().amax() gives). For bf16 / fp16 /
    fp32 one pass over the bits, block by block; other dtypes (fp8, float64) through float32."""
    found = _MAGNITUDE_BITS.get(states.dtype)
    if found is None:
        return states.float().abs().amax(dim=-1)
    int_dtype, mask = found
    bits = states.view(int_dtype)
    out = torch.empty(states.shape[:-1], dtype=int_dtype, device=states.device)
    step = _block_rows(states, states.element_size())
    for i in range(0, states.shape[0], step):
        torch.amax(bits[i:i + step] & mask, dim=-1, out=out[i:i + step])
    return out.view(states.dtype)


def quantize(states: torch.Tensor, storage_dtype: str, magnitudes: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`states` [t, L, H] as stored: (the stored tensor, its scales [t, L, 1] float32 when scaled, else None).
    `magnitudes`: the states' `row_magnitudes(states)` when the caller has them already (the check read them).

    fp8: scale = amax / 448 clamped at 1e-12, stored = clamp(x / scale, +-448) cast to e4m3 — computed in float32
    block by block, byte for byte what the whole-tensor expression gives."""
    if not is_scaled(storage_dtype):
        return states.to(getattr(torch, storage_dtype)) if storage_dtype != MODEL else states, None
    amax = (magnitudes if magnitudes is not None else row_magnitudes(states)).float().unsqueeze(-1)
    scales = (amax / FP8_MAX).clamp(min=SCALE_FLOOR)  # [t, L, 1]
    stored = torch.empty(states.shape, dtype=torch.float8_e4m3fn, device=states.device)
    step = _block_rows(states, 4)
    buf = torch.empty((min(step, states.shape[0]), *states.shape[1:]), dtype=torch.float32, device=states.device)
    for i in range(0, states.shape[0], step):
        block = buf[:min(step, states.shape[0] - i)]
        torch.div(states[i:i + step], scales[i:i + step], out=block)  # in float32: the exact upcast, then the divide
        block.clamp_(-FP8_MAX, FP8_MAX)
        stored[i:i + step].copy_(block)
    return stored, scales


def dequantize(stored: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The states a stored tensor holds, in `dtype`: stored.to(dtype) * scales.to(dtype) (speculators' rule)."""
    if scales is None:
        return stored if stored.dtype == dtype else stored.to(dtype)
    return stored.to(dtype) * scales.to(dtype)


class StateChecker:
    """The pass that finds states never to be committed, fed chunk by chunk along the token axis (a long request's
    rows are checked as they go to its spool, the others all at once by `state_problem`); same findings, same
    messages, same order as one pass over the whole sample:

        feed(states, token_ids, logprobs=None) -> problem | None   states [t, L, H], token_ids [t], logprobs [t, K]:
                                                                    the first NaN/Inf of the states, at once
        finish() -> problem | None                                  a layer of zeros over distinct tokens, else the
                                                                    first non-finite target log-probability

    A layer of zeros counts only over more than one distinct token: a model's own embedding row may be zero
    (padding_idx rows are), and a bias-free decoder keeps such a token zero through every layer, so a sample of one
    repeated token can be zero by right; zeros across different tokens mean the states were never captured."""

    def __init__(self, layer_ids: Sequence[int] | None = None) -> None:
        self._layer_ids = layer_ids
        self._tokens = 0
        self._zero: torch.Tensor | None = None  # per layer: every value so far is zero
        self._distinct: set[int] = set()  # up to two distinct token ids
        self._logprob_problem: str | None = None

    def _which(self, position: int) -> str:
        return f"layer {position}" + (f" (hidden-state id {self._layer_ids[position]})" if self._layer_ids else "")

    def feed(self, states: torch.Tensor, token_ids: torch.Tensor | None = None,
             logprobs: torch.Tensor | None = None, magnitudes: torch.Tensor | None = None) -> str | None:
        """`magnitudes`: `row_magnitudes(states)` when the caller has them (they are what the check reads)."""
        first = self._tokens
        self._tokens += states.shape[0]
        if token_ids is not None and len(self._distinct) < 2:
            self._distinct.update(int(t) for t in token_ids.unique()[:2])
        if logprobs is not None and self._logprob_problem is None:
            finite = torch.isfinite(logprobs)
            if not bool(finite.all()):
                t, rank = (~finite).nonzero()[0].tolist()
                self._logprob_problem = (f"non-finite target log-probability ({logprobs[t, rank].item()}) at token "
                                         f"{first + t}, rank {rank}")
        if states.numel() == 0:
            return None
        m = magnitudes if magnitudes is not None else row_magnitudes(states)  # [t, L]
        finite = torch.isfinite(m)
        if not bool(finite.all()):
            t, layer = (~finite).nonzero()[0].tolist()  # the first row holding one, as the element-wise scan finds
            if states.element_size() == 1:  # quantized on the device: the value is gone, its row's magnitude is not
                return f"non-finite value (magnitude {m[t, layer].item()}) at token {first + t}, {self._which(layer)}"
            row = states[t, layer].float()
            value = row[~torch.isfinite(row)][0].item()
            return f"non-finite value ({value}) at token {first + t}, {self._which(layer)}"
        nonzero = (m != 0).any(dim=0)  # [L]: a row of zeros (-0.0 included) has magnitude 0
        self._zero = ~nonzero if self._zero is None else self._zero & ~nonzero
        return None

    def finish(self, *, distinct_tokens_known: bool = True) -> str | None:
        """`distinct_tokens_known`: token ids were fed (without them any layer of zeros counts)."""
        zero_counts = not distinct_tokens_known or len(self._distinct) >= 2
        if zero_counts and self._zero is not None and bool(self._zero.any()):
            layer = int(self._zero.nonzero()[0])
            return f"{self._which(layer)} is all zeros over all {self._tokens} tokens"
        return self._logprob_problem


def state_problem(chunks: Sequence[torch.Tensor], layer_ids: Sequence[int] | None = None,
                  token_ids: Sequence[torch.Tensor] | None = None,
                  logprobs: Sequence[torch.Tensor] | None = None,
                  magnitudes: Sequence[torch.Tensor] | None = None) -> str | None:
    """Why states given as chunks along the token axis ([t_i, L, H] each, in order) must not be committed: the first
    NaN or Inf (by token and layer position), else a layer whose every value is zero (a capture that never ran, the
    failure vLLM and speculators shipped; counted over distinct `token_ids` only, see StateChecker), else the first
    non-finite `logprobs` (a top-k target's, [t_i, K] chunks alike), else None. `layer_ids` names each layer
    position's hidden-state id."""
    checker = StateChecker(layer_ids)
    for i, chunk in enumerate(chunks):
        problem = checker.feed(chunk, None if token_ids is None else token_ids[i],
                               None if logprobs is None else logprobs[i], None if magnitudes is None else magnitudes[i])
        if problem is not None:
            return problem
    return checker.finish(distinct_tokens_known=token_ids is not None)
