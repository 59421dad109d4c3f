"""Fixtures for the training-feed tests: runs built through the real connector (the oracle run, a plain transformers
forward of the tiny Llama, is the whole suite's: tests/conftest.py)."""

from __future__ import annotations

import pytest

from connectors import HiddenStatesSpec
from harness.runs import (
    ORACLE_LAYERS,  # noqa: F401 - the oracle run's layers, as the tests import them
    random_samples,
    write_run,
)


@pytest.fixture(scope="session")
def random_run(tmp_path_factory):
    """(output, samples, spec): 12 random bf16 samples, 3 layers of width 16, manifest in two parts."""
    spec = HiddenStatesSpec(layer_ids=(2, 3, 6), num_hidden_layers=6, hidden_size=16, dtype="bfloat16",
                            model="tiny/random")
    samples = random_samples(12, spec, seed=1)
    out = str(tmp_path_factory.mktemp("random-run"))
    write_run(out, samples, spec, manifest_parts=2)
    return out, samples, spec
