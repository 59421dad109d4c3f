"""Which target a draft was made for, told by content: a drafter that reads its target's own tensors (MTP layers
share its input embeddings, final norm and lm_head) is only right for that target, and another target of the same
shape (another fine-tune, another seed) loads without a shape error and drafts wrongly.

    target_digest(model_dir)                   VALUE_DIGEST_PREFIX + prefix of sha256 over the shared tensors'
                                               values (what MTP checkpoints record): equal for a copy of the target
                                               in another storage dtype, different for another target
    check_made_for(draft_dir, target_dir, recorded, what, allow_mismatch=False, override=None)
                                               ValueError unless `recorded` (the digest a checkpoint recorded, or
                                               None: `draft_dir` is a target folder itself, compared by value) names
                                               `target_dir`; `allow_mismatch` (the user's override) logs instead

The value digest hashes each tensor rounded to bfloat16 (round to nearest even), values under float16's smallest
normal (2^-14) counted as 0: the same numbers whichever of bfloat16, float16 or float32 the folder stores them in,
for a bfloat16 target re-cast to float16 or float32 (bfloat16 values from 2^-14 up to float16's largest are float16
values), and for a float16 or float32 target re-cast to bfloat16 (rounding twice to bfloat16 is rounding once). A
float32 target cast to float16 rounds twice on the way to bfloat16 and may differ in a few values: refused, with the
override named. Checkpoints written before it record STORED_DIGEST_PREFIX: the bytes as stored, compared as such
(their own target still matches; a re-cast copy of it needs the override).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator

import torch

from drafters.base import TargetHead

logger = logging.getLogger(__name__)

VALUE_DIGEST_PREFIX = "sha256-bf16:"
"""The digest of the shared tensors' values (target_digest), what checkpoints record."""
STORED_DIGEST_PREFIX = "sha256:"
"""The digest of their bytes as stored (shape, dtype, bytes), what checkpoints recorded before; read, not written."""
_TINY = 2.0 ** -14  # float16's smallest normal: values under it are not kept exactly by a float16 copy
_PIECE = 1 << 22  # elements rounded at a time: memory stays a few MiB over the tensors themselves


def _shared(head: TargetHead) -> list[torch.Tensor]:
    return [head.embed_tokens, head.lm_head, *head.norm.module.state_dict().values()]


def _values(tensor: torch.Tensor) -> Iterator[bytes]:
    """`tensor` rounded to bfloat16, tiny values 0 (see the module docstring), piece by piece as bytes."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_floating_point():  # nothing to round: its values as they are
        yield flat.contiguous().view(torch.uint8).numpy().tobytes()
        return
    for start in range(0, flat.numel(), _PIECE):
        piece = flat[start:start + _PIECE].to(torch.bfloat16)  # [n] round to nearest even, from any float dtype
        piece = torch.where(piece.abs() < _TINY, torch.zeros_like(piece), piece)  # -0.0 and tiny values: +0
        yield piece.contiguous().view(torch.uint8).numpy().tobytes()


def _value_digest(head: TargetHead) -> str:
    digest = hashlib.sha256()
    for tensor in _shared(head):
        digest.update(str(tuple(tensor.shape)).encode())
        for piece in _values(tensor):
            digest.update(piece)
    return VALUE_DIGEST_PREFIX + digest.hexdigest()[:32]


def _stored_digest(head: TargetHead) -> str:
    digest = hashlib.sha256()
    for tensor in _shared(head):
        digest.update(str((tuple(tensor.shape), tensor.dtype)).encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy())
    return STORED_DIGEST_PREFIX + digest.hexdigest()[:32]


def target_digest(model_dir: str) -> str:
    """The identity of the tensors a draft shares with the target at `model_dir` (input embeddings, lm_head, final
    norm), by value: the same for a copy of it stored in another dtype (see the module docstring)."""
    return _value_digest(TargetHead.from_model_dir(model_dir))


def _digest_like(recorded: str, model_dir: str) -> str:
    """`model_dir`'s digest of the kind `recorded` is."""
    head = TargetHead.from_model_dir(model_dir)
    return _stored_digest(head) if recorded.startswith(STORED_DIGEST_PREFIX) else _value_digest(head)


def check_made_for(draft_dir: str, target_dir: str, recorded: str | None, what: str, *, allow_mismatch: bool = False,
                   override: str | None = None) -> None:
    """ValueError when the draft at `draft_dir` was made for another target than `target_dir`: `recorded` is the
    digest its checkpoint recorded (None: `draft_dir` is a target folder whose own tensors are compared). A draft in
    the target's own folder is its own; a target that is not a local folder cannot be compared (logged).
    `allow_mismatch`: the user says they fit (logged, not refused); `override`: how they say it, named in the
    refusal (e.g. "pass --allow-target-mismatch")."""
    if os.path.realpath(draft_dir) == os.path.realpath(target_dir):
        return
    if not os.path.isdir(target_dir):
        logger.warning("%s: cannot check that %s was made for %s (not a local folder)", what, draft_dir, target_dir)
        return
    if recorded is not None and not recorded.startswith((VALUE_DIGEST_PREFIX, STORED_DIGEST_PREFIX)):
        theirs, ours, why = recorded, "", f"it records a target digest hsx does not know ({recorded[:60]!r})"
    else:
        theirs = recorded if recorded is not None else target_digest(draft_dir)
        ours = _digest_like(theirs, target_dir)
        why = ""
        if theirs == ours:
            return
        if theirs.startswith(STORED_DIGEST_PREFIX):
            why = (f"it records an earlier hsx's digest of its target's bytes as stored, {theirs}, which "
                   f"{target_dir}'s, {ours}, does not match (nor would a copy of the same target in another dtype)")
    source = "was tuned for" if recorded is not None else "belongs to"
    if allow_mismatch:
        logger.warning("%s: %s %s another target than %s (%s vs %s); used anyway, as asked", what, draft_dir, source,
                       target_dir, theirs, ours)
        return
    detail = why or f"their input embeddings, final norm or lm_head differ by value: {theirs} vs {ours}"
    anyway = f"; if you know they fit (the same target requantized, say), {override}" if override else ""
    raise ValueError(f"{what}: {draft_dir} {source} another target than {target_dir} ({detail}); use MTP layers of "
                     f"{target_dir} itself, or tune them with `hsx train-drafter --kind mtp --model {target_dir}`"
                     f"{anyway}")
