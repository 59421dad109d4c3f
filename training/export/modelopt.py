"""ModelOpt's layout: what its HF-based data generator writes, and its trainer reads.

    DEST/{conversation_id}.pt   torch.save of input_ids [T], hidden_states [T, H] POST-norm (ModelOpt's generator saves
                                HF's `last_hidden_state`), aux_hidden_states [T, (L-1)*H], loss_mask [T],
                                conversation_id (the sample id; the file name is its `safe_file_stem`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from connectors.paths import safe_file_stem
from connectors.run import RunSpec
from training.export import files

if TYPE_CHECKING:
    from training.dataset import HiddenStatesDataset


@dataclass
class ModelOptLayout:
    dest: str
    """The export's local folder."""
    run: RunSpec
    """The run being exported."""
    dataset_layout: str = "eagle3"
    """HiddenStatesDataset layout the writer takes items in."""
    needs_post_norm: bool = True
    """ModelOpt takes the last layer after the final norm."""
    stored_states: bool = False
    """Items come dequantized to the model dtype (ModelOpt reads no fp8)."""

    def relpath(self, index: int, sample_id: str) -> str:
        return f"{safe_file_stem(sample_id)}.pt"

    def is_complete(self, path: str, num_tokens: int) -> bool:
        return files.torch_file_tokens(path, "input_ids") == num_tokens

    def write(self, path: str, item: dict[str, Any]) -> None:
        obj = {"input_ids": item["input_ids"],  # [T] int64
               "hidden_states": item["target_hidden_states"].contiguous(),  # [T, H] post-norm
               "aux_hidden_states": item["aux_hidden_states"].contiguous(),  # [T, (L-1)*H]
               "loss_mask": item["loss_mask"],  # [T] int64
               "conversation_id": str(item["sample_id"])}
        files.put(path, lambda f: torch.save(obj, f))

    def on_export_complete(self, ds: HiddenStatesDataset) -> None:
        pass
