"""The worked example runs end to end (engine -> run -> dataset -> EAGLE-3-style head) and its loss goes down."""

from __future__ import annotations

import importlib.util
import os

import pytest

from connectors.manifest import ok_rows

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "eagle3_tiny_head.py")


@pytest.mark.slow
def test_the_tiny_eagle3_head_example_learns(tmp_path):
    spec = importlib.util.spec_from_file_location("eagle3_tiny_head", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(["--workdir", str(tmp_path), "--samples", "16", "--steps", "60", "--batch-size", "4"])
    assert len(losses) == 60
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert ok_rows(str(tmp_path / "run")).num_rows == 16  # the run's manifest, committed through connectors.run
