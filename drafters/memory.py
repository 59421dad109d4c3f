"""The memory levers of drafter training, each behind a flag of `hsx train-drafter`: the first two equal in result to
running without them, bf16 autocast within bf16's precision.

    MemoryOptions                     --gradient-checkpointing, --ce-chunk-tokens N, --autocast bfloat16
    cross_entropy(hidden, readout, teacher, chunk=, weight=)   sum over rows of the cross-entropy of readout(hidden)
                                      against the teacher (probabilities or token ids), and each row's argmax; with
                                      chunk > 0 the logits of `chunk` rows at a time, recomputed in the backward, so
                                      a [rows, vocabulary] tensor is never kept (128k logits of 32k tokens: 16 GB)
    rows_of(table, rows, cols)        a teacher reading a [R, S, D] table at packed positions
    softmax_of(readout, states)       a teacher computing softmax(readout(states)) at the rows a chunk reads
    chunked_argmax(readout, states, chunk)   the greedy token of each state, `chunk` rows of logits at a time
    recompute_in_backward(module)     the module's activations are not kept: its forward runs again in the backward
                                      (torch.utils.checkpoint); for modules without side effects (MLPs, DFlash layers)
    autocast(options, device)         the training step's autocast context (a no-op without --autocast)
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

AUTOCAST_DTYPES = ("bfloat16",)


logger = logging.getLogger(__name__)

MIN_USEFUL_CE_CHUNK = 256
"""Below this many rows per chunk the per-chunk matmuls cost more than the memory they save (warned)."""


@dataclass(frozen=True)
class MemoryOptions:
    """How a drafter's training step trades compute for memory (none of it changes what is learned)."""

    gradient_checkpointing: bool = False
    """Recompute in the backward what each family names (Drafter.recomputable: the draft layers' MLPs; DFlash's
    layers; Medusa's residual blocks; MLPSpeculator's stage norms)."""
    ce_chunk_tokens: int = 0
    """Cross-entropy over the vocabulary in chunks of this many rows, logits recomputed in the backward (0: whole)."""
    autocast: str | None = None
    """Run the step under torch.autocast in this dtype (bfloat16), weights and optimizer state in --dtype."""

    def __post_init__(self) -> None:
        if self.ce_chunk_tokens < 0:
            raise ValueError(f"--ce-chunk-tokens must be >= 0 (0: no chunking), got {self.ce_chunk_tokens}")
        if 0 < self.ce_chunk_tokens < MIN_USEFUL_CE_CHUNK:
            logger.warning("--ce-chunk-tokens %d recomputes the logits %d rows at a time: the same result, but each "
                           "chunk is a matmul of its own (1 ran 10x slower); %d-8192 keeps the saving",
                           self.ce_chunk_tokens, self.ce_chunk_tokens, MIN_USEFUL_CE_CHUNK)
        if self.autocast is not None and self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(f"--autocast {self.autocast!r}: use {' or '.join(AUTOCAST_DTYPES)} (or leave it out)")


Teacher = Callable[[torch.Tensor], torch.Tensor] | torch.Tensor
"""Per row the target: probabilities [n, D] (soft labels) or token ids [n] (hard labels); a callable takes the rows'
indices (computed under no_grad, chunk by chunk)."""


def _teacher_at(teacher: Teacher, index: torch.Tensor) -> torch.Tensor:
    if callable(teacher):
        with torch.no_grad():
            return teacher(index)
    return teacher[index]


def _rows_of(table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return table[rows[index], cols[index]]


def rows_of(table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A teacher reading table [R, S, ...] at (rows, cols)[index], bound now (the backward may call it later)."""
    return functools.partial(_rows_of, table, rows, cols)


def _softmax_of(readout: Callable[[torch.Tensor], torch.Tensor], states: torch.Tensor,
                index: torch.Tensor) -> torch.Tensor:
    return F.softmax(readout(states[index]).float(), dim=-1)


def softmax_of(readout: Callable[[torch.Tensor], torch.Tensor], states: torch.Tensor
               ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A teacher: rows `index` of states [n, H] -> softmax(readout(states[index])) [len, V], bound now."""
    return functools.partial(_softmax_of, readout, states)


def chunked_argmax(readout: Callable[[torch.Tensor], torch.Tensor], states: torch.Tensor, chunk: int = 0
                   ) -> torch.Tensor:
    """[n] argmax of readout(states [n, H]), `chunk` rows of logits at a time (0: all at once); empty for n = 0."""
    if not len(states):
        return torch.zeros(0, dtype=torch.long, device=states.device)
    return torch.cat([readout(part).argmax(-1) for part in states.split(chunk or len(states))])


def _chunk_loss(readout, teacher, weight, index, hidden):
    logits = readout(hidden).float()
    per = F.cross_entropy(logits, _teacher_at(teacher, index), reduction="none")
    if weight is not None:
        per = per * weight[index]
    return per.sum(), logits.argmax(-1)


def cross_entropy(hidden: torch.Tensor, readout: Callable[[torch.Tensor], torch.Tensor], teacher: Teacher, *,
                  chunk: int = 0, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H] -> (sum over rows of weight x cross-entropy(readout(hidden) [N, D] float32, teacher), argmax
    [N] of the logits). chunk > 0: `chunk` rows at a time under torch.utils.checkpoint, so only one chunk's logits
    live at once in the forward and again in the backward; the result equals the unchunked one."""
    n = hidden.shape[0]
    everything = torch.arange(n, device=hidden.device)
    if chunk <= 0 or n <= chunk:
        return _chunk_loss(readout, teacher, weight, everything, hidden)
    total, best = hidden.new_zeros((), dtype=torch.float32), []
    for start in range(0, n, chunk):
        index = everything[start:start + chunk]
        part, arg = checkpoint(_chunk_loss, readout, teacher, weight, index, hidden[start:start + chunk],
                               use_reentrant=False)
        total, best = total + part, best + [arg]
    return total, torch.cat(best)


def _recomputed(forward, *args, **kwargs):
    if torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)


def recompute_in_backward(module: torch.nn.Module, on: bool = True) -> None:
    """Make `module`'s forward keep no activations for the backward (it runs again there); on=False undoes it. Its
    forward must have no side effects (a KV cache update would happen twice)."""
    wrapped = isinstance(module.forward, functools.partial) and module.forward.func is _recomputed
    if on and not wrapped:
        module.forward = functools.partial(_recomputed, module.forward)
    elif not on and wrapped:
        del module.forward  # the class's forward again


def autocast(options: MemoryOptions, device: torch.device):
    """The context a training step runs in: torch.autocast(device, options.autocast) or nothing."""
    if options.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, options.autocast))
