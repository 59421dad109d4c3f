"""The training package's boundary: it reads runs through connectors and never pulls in ray or the job code."""

from __future__ import annotations

import subprocess
import sys


def test_training_imports_neither_ray_nor_jobs():
    code = ("import sys, training, training.dataset, extractor.norm, training.sampler, training.collate, "
            "training.export\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'jobs'))\n"
            "assert not bad, bad\n"
            "assert training.export_run is training.export.export_run\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
