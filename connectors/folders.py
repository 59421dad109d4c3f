"""What a local folder holds, by the names in it: a model, an extraction run. The lowest of connectors' path
modules, so that the path policy (paths.py), the output guards (outputs.py) and the run format (run.py) share one
answer without importing each other.

    RUN_JSON, DATA_DIR, MANIFEST_DIR   the names of a run's spec file and folders (connectors/run.py's layout)
    WEIGHT_SUFFIXES                    what makes a folder beside config.json a model
    holds_model(folder) / holds_run(folder)
"""

from __future__ import annotations

import os

from connectors import fingerprint

RUN_JSON = "run.json"
DATA_DIR = "data"
MANIFEST_DIR = "manifest"
WEIGHT_SUFFIXES = (*fingerprint.WEIGHT_SUFFIXES, ".ckpt", ".safetensors.index.json", ".bin.index.json")
"""What makes a folder beside config.json a model to protect: the fingerprint's weight files, checkpoints, and the
index of sharded weights."""


def holds_model(folder: str) -> bool:
    """Whether `folder` holds a model: a config.json beside weight files (a Hugging Face checkpoint, a drafter)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return "config.json" in names and any(n.endswith(WEIGHT_SUFFIXES) for n in names)


def holds_run(folder: str) -> bool:
    """Whether `folder` holds an extraction run (run.json, or a manifest/ folder)."""
    return os.path.isfile(os.path.join(folder, RUN_JSON)) or os.path.isdir(os.path.join(folder, MANIFEST_DIR))
