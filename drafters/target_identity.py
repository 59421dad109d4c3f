"""Which target a draft was made for, told by content: a drafter that reads its target's own tensors (MTP layers
share its input embeddings, final norm and lm_head) is only right for that target, and another target of the same
shape (another fine-tune, another seed) loads without a shape error and drafts wrongly.

    target_digest(model_dir)                   "sha256:" + prefix over the shared tensors' bytes as the folder stores
                                               them: equal for a copy of the folder, different for another target
    check_made_for(draft_dir, target_dir, recorded, what)
                                               ValueError unless `recorded` (the digest a checkpoint recorded, or
                                               None: `draft_dir` is a target folder itself, compared tensor for
                                               tensor) names `target_dir`
"""

from __future__ import annotations

import hashlib
import logging
import os

import torch

from drafters.base import TargetHead

logger = logging.getLogger(__name__)

DIGEST_PREFIX = "sha256:"


def target_digest(model_dir: str) -> str:
    """The identity of the tensors a draft shares with the target at `model_dir` (input embeddings, lm_head, final
    norm), in the dtype the folder stores them."""
    head = TargetHead.from_model_dir(model_dir)
    digest = hashlib.sha256()
    for tensor in (head.embed_tokens, head.lm_head, *head.norm.module.state_dict().values()):
        digest.update(str((tuple(tensor.shape), tensor.dtype)).encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy())
    return DIGEST_PREFIX + digest.hexdigest()[:32]


def check_made_for(draft_dir: str, target_dir: str, recorded: str | None, what: str) -> None:
    """ValueError when the draft at `draft_dir` was made for another target than `target_dir`: `recorded` is the
    digest its checkpoint recorded (None: `draft_dir` is a target folder whose own tensors are compared). A draft in
    the target's own folder is its own; a target that is not a local folder cannot be compared (logged)."""
    if os.path.realpath(draft_dir) == os.path.realpath(target_dir):
        return
    if not os.path.isdir(target_dir):
        logger.warning("%s: cannot check that %s was made for %s (not a local folder)", what, draft_dir, target_dir)
        return
    theirs = recorded if recorded is not None else target_digest(draft_dir)
    ours = target_digest(target_dir)
    if theirs != ours:
        source = "was tuned for" if recorded is not None else "belongs to"
        raise ValueError(f"{what}: {draft_dir} {source} another target than {target_dir} (their input embeddings, "
                         f"final norm or lm_head differ: {theirs} vs {ours}); use MTP layers of {target_dir} itself, "
                         "or tune them with `hsx train-drafter --kind mtp --model " + target_dir + "`")
