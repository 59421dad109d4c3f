"""`hsx merge-mtp`: a new target folder with tuned MTP layers (drafters/mtp_checkpoint.py's write_target_with). Imports no torch,
so building the `hsx` parser stays cheap."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MergeMtpConfig:
    """One merge (`hsx merge-mtp --model TARGET --drafter TUNED --out NEW`); flags map one to one onto these fields."""

    model: str
    """The target folder whose MTP layers were tuned; read only, never written."""
    drafter: str
    """The tuned MTP layers: a `hsx train-drafter --kind mtp --model TARGET` checkpoint folder."""
    out: str
    """The new target folder: every file of --model, its MTP tensors replaced by --drafter's (must not exist, or be
    empty)."""
    allow_target_mismatch: bool = False
    """Merge --drafter although it records another target than --model (its embeddings, final norm or lm_head differ
    by value): for a target you know is the same, requantized say. Keys and shapes are still checked."""

    def __post_init__(self) -> None:
        for name in ("model", "drafter"):
            if not os.path.isdir(str(getattr(self, name) or "")):
                raise ValueError(f"--{name} {getattr(self, name)!r} is not a local folder")
        if not self.out or "://" in self.out:
            raise ValueError(f"--out {self.out!r} must be a local folder (a target serving engines load from disk)")
        from connectors.outputs import check_output_place

        # never inside --model or --drafter (a whole model folder written into the target, copied by the next merge)
        check_output_place(self.out, flag="--out", inputs={"--model": self.model, "--drafter": self.drafter},
                           around_ok=False)


def merge_mtp(config: MergeMtpConfig) -> dict[str, Any]:
    """Write config.out (see MergeMtpConfig); what was replaced."""
    from drafters.mtp_checkpoint import write_target_with

    return write_target_with(config.model, config.drafter, config.out,
                             allow_target_mismatch=config.allow_target_mismatch)
