"""hsx training: feeding an extraction run to a drafter trainer, or rewriting it for another trainer.

    dataset.py     HiddenStatesDataset(output, ...), HiddenStatesDatasetConfig, read_run_info(output) -> RunSpec
    norm.py        FinalNorm: the target model's final norm (transformers' own module, weights from the checkpoint)
    sampler.py     ShardSampler: each distributed rank a disjoint share, all ranks together every sample once
    collate.py     PadCollator, PackCollator: batches padded to the longest sample, or packed rows for varlen attention
    export/        export_run(output, dest, fmt): the run in speculators', SpecForge's or ModelOpt's on-disk layout
                   (`hsx export`), one module per layout

Reads runs through `connectors.run` (the run format's one owner) and `connectors.format`. This package imports
connectors, torch and transformers; never ray or jobs. The names below load lazily: `import training` is cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "HiddenStatesDataset": "training.dataset",
    "HiddenStatesDatasetConfig": "training.dataset",
    "read_run_info": "training.dataset",
    "FinalNorm": "extractor.norm",
    "ShardSampler": "training.sampler",
    "PadCollator": "training.collate",
    "PackCollator": "training.collate",
    "ExportConfig": "training.export",
    "ExportSummary": "training.export",
    "export_run": "training.export",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'training' has no attribute {name!r}")
