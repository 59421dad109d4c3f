"""speculators' layout: what its vLLM-based data generator writes, and its trainer reads.

    DEST/hidden_states/hs_{i}.safetensors   token_ids [T], hidden_states [T, L, H] (every stored layer; the last one
                                            PRE-norm: speculators' generator stores it so, and its trainer applies the
                                            verifier's norm itself), loss_mask [T] (an extra key its loader ignores);
                                            an fp8 run's states pass through as stored: float8_e4m3fn hidden_states
                                            and float32 hidden_states_scales [T, L, 1] (speculators' FP8 reader
                                            computes fp8.to(dtype) * scales.to(dtype), which broadcasts our
                                            per-token-per-layer scales as it does its own [T, 1, 1]); other storage
                                            dtypes pass through as stored too
    DEST/ (a `datasets.save_to_disk` folder) data-00000-of-00001.arrow (input_ids, loss_mask, seq_len; row i <-> hs_{i}),
                                            dataset_info.json, state.json
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from connectors import safetensors_file
from connectors.format import HIDDEN_STATES_SCALES
from connectors.run import RunSpec
from training.export import files

if TYPE_CHECKING:
    from training.dataset import HiddenStatesDataset

ARROW_BATCH_ROWS = 1024
ARROW_FILE = "data-00000-of-00001.arrow"


@dataclass
class SpeculatorsLayout:
    dest: str
    """The export's local folder."""
    run: RunSpec
    """The run being exported (its layer ids and model go into each file's metadata)."""
    dataset_layout: str = "raw"
    """HiddenStatesDataset layout the writer takes items in."""
    needs_post_norm: bool = False
    """speculators takes the last layer pre-norm, as the run stores it."""
    stored_states: bool = True
    """Items hold the states as the run stores them (fp8 with its scales): speculators reads fp8 itself."""

    def relpath(self, index: int, sample_id: str) -> str:
        return f"hidden_states/hs_{index}.safetensors"

    def is_complete(self, path: str, num_tokens: int) -> bool:
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                return f.get_slice("token_ids").get_shape() == [num_tokens]
        except Exception:  # noqa: BLE001 - any unreadable file is rewritten
            return False

    def write(self, path: str, item: dict[str, Any]) -> None:
        tensors = {"token_ids": item["input_ids"].contiguous(),  # [T] int64
                   "hidden_states": item["hidden_states"].contiguous()}  # [T, L, H] as stored, last layer pre-norm
        if HIDDEN_STATES_SCALES in item:
            tensors[HIDDEN_STATES_SCALES] = item[HIDDEN_STATES_SCALES].contiguous()  # [T, L, 1] float32
        tensors["loss_mask"] = item["loss_mask"].contiguous()  # [T]
        meta = {"format": "speculators", "layer_ids": json.dumps(list(self.run.layer_ids)),
                "layer_id_convention": self.run.layer_id_convention, "last_layer_normalized": "false",
                "model": self.run.model, "sample_id": str(item["sample_id"])}
        if self.run.storage_dtype:
            meta.update(dtype=self.run.dtype, storage_dtype=self.run.storage_dtype)
        files.put(path, safetensors_file.safetensors_content(tensors, meta))

    def on_export_complete(self, ds: HiddenStatesDataset) -> None:
        """The `datasets.save_to_disk` folder: one Arrow stream file plus its JSON sidecars, rows in hs_{i} order."""
        from safetensors import safe_open

        features = {"input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "Sequence"},
                    "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "Sequence"},
                    "seq_len": {"dtype": "int64", "_type": "Value"}}
        schema = pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
                            ("seq_len", pa.int64())],
                           metadata={"huggingface": json.dumps({"info": {"features": features}})})
        digest = hashlib.sha256()

        def rows() -> Iterator[pa.RecordBatch]:
            ids, masks, lens = [], [], []
            for i in range(len(ds)):
                with safe_open(os.path.join(self.dest, self.relpath(i, "")), framework="pt") as f:
                    tok, mask = f.get_tensor("token_ids"), f.get_tensor("loss_mask")  # [T], [T]
                ids.append(tok.tolist())
                masks.append(mask.tolist())
                lens.append(len(tok))
                digest.update(tok.numpy().tobytes())
                if len(ids) == ARROW_BATCH_ROWS or i == len(ds) - 1:
                    yield pa.record_batch([pa.array(ids, pa.list_(pa.int64())), pa.array(masks, pa.list_(pa.int64())),
                                           pa.array(lens, pa.int64())], schema=schema)
                    ids, masks, lens = [], [], []

        def write_stream(f) -> None:
            with pa.ipc.new_stream(f, schema) as writer:
                for batch in rows():
                    writer.write_batch(batch)

        files.put(os.path.join(self.dest, ARROW_FILE), write_stream)
        info = {"citation": "", "description": f"hsx export of {self.run.model or 'a run'} for speculators",
                "features": features, "homepage": "", "license": ""}
        state = {"_data_files": [{"filename": ARROW_FILE}], "_fingerprint": digest.hexdigest()[:16],
                 "_format_columns": None, "_format_kwargs": {}, "_format_type": "torch",
                 "_output_all_columns": False, "_split": None}
        for name, doc in (("dataset_info.json", info), ("state.json", state)):
            files.put(os.path.join(self.dest, name), json.dumps(doc, indent=2).encode())
