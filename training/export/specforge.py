"""SpecForge's layout: what its SGLang-based data generator writes, and its trainer reads.

    DEST/rows_{a}-{b}/data_{i}.ckpt   torch.save of input_ids [T], loss_mask [T], hidden_state [1, T, H] POST-norm
                                      (SpecForge saves the input of SGLang's logits processor, i.e. after the final
                                      norm, and its trainer feeds it to the LM head as is), aux_hidden_state
                                      [1, T, (L-1)*H]; folders of ROWS_PER_FOLDER rows
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from connectors.run import RunSpec
from training.export import files

if TYPE_CHECKING:
    from training.dataset import HiddenStatesDataset

ROWS_PER_FOLDER = 2000


@dataclass
class SpecForgeLayout:
    dest: str
    """The export's local folder."""
    run: RunSpec
    """The run being exported."""
    dataset_layout: str = "eagle3"
    """HiddenStatesDataset layout the writer takes items in."""
    needs_post_norm: bool = True
    """SpecForge takes the last layer after the final norm."""
    stored_states: bool = False
    """Items come dequantized to the model dtype (SpecForge reads no fp8)."""

    def relpath(self, index: int, sample_id: str) -> str:
        a = index // ROWS_PER_FOLDER * ROWS_PER_FOLDER
        return f"rows_{a}-{a + ROWS_PER_FOLDER}/data_{index}.ckpt"

    def is_complete(self, path: str, num_tokens: int) -> bool:
        return files.torch_file_tokens(path, "input_ids") == num_tokens

    def write(self, path: str, item: dict[str, Any]) -> None:
        obj = {"input_ids": item["input_ids"],  # [T] int64
               "loss_mask": item["loss_mask"],  # [T] int64
               "hidden_state": item["target_hidden_states"][None].contiguous(),  # [1, T, H] post-norm
               "aux_hidden_state": item["aux_hidden_states"][None].contiguous()}  # [1, T, (L-1)*H]
        files.put(path, lambda f: torch.save(obj, f))

    def on_export_complete(self, ds: HiddenStatesDataset) -> None:
        pass
