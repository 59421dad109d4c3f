"""Export: rewrite an extraction run into the on-disk layout another drafter trainer reads (`hsx export`).

    config.py        ExportConfig, FORMATS: one export's settings (no torch import: the CLI builds its flags from it)
    exporter.py      ExportSummary, ExportPlan, prepare_export(config) -> plan (every check, before anything is
                     written), execute_export(plan) (the work, under DEST's writer lease, resumable), export_run(output,
                     dest, fmt, ...) (both), STATE_FILE / JOURNAL_FILE
    speculators.py   SpeculatorsLayout    hidden_states/hs_{i}.safetensors (last layer PRE-norm; an fp8 run's states
                                          and scales as stored) + Arrow dataset
    specforge.py     SpecForgeLayout      rows_{a}-{b}/data_{i}.ckpt (hidden_state POST-norm)
    modelopt.py      ModelOptLayout       {sample_id}.pt (hidden_states POST-norm)
    files.py         put (the one atomic durable write, on the local disk), the journal, read-back checks

The names below load lazily: `import training.export.config` (the command line's) does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "FORMATS": "training.export.config",
    "ExportConfig": "training.export.config",
    "ExportPlan": "training.export.exporter",
    "ExportSummary": "training.export.exporter",
    "JOURNAL_FILE": "training.export.exporter",
    "STATE_FILE": "training.export.exporter",
    "execute_export": "training.export.exporter",
    "export_run": "training.export.exporter",
    "prepare_export": "training.export.exporter",
}

__all__ = ["FORMATS", "ExportConfig", "ExportPlan", "ExportSummary", "execute_export", "export_run",
           "prepare_export"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'training.export' has no attribute {name!r}")
