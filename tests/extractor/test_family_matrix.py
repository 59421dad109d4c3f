"""The target-family coverage matrix (benchmarks/family_matrix.py) in the suite: every family of reference.tiny_models
through every column, each checked against transformers (forward, last_hidden_state, logits, generate); and
docs/families.md is that script's output for exactly these families and columns, so it cannot drift."""

from __future__ import annotations

import os
import re

import pytest
import transformers

from benchmarks.family_matrix import BEGIN, COLUMNS, SLOW_COLUMNS, build, read_table, reference, run_cell
from reference.tiny_models import FAMILIES

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "families.md")

MATRIX_FAMILIES = 14
"""Families the matrix must pass in every column that applies (issue: today's seven plus seven new)."""


def _documented_transformers() -> str:
    with open(DOCS) as f:
        return re.search(r"\(transformers ([0-9.]+)", f.read().split(BEGIN, 1)[1]).group(1)


def _same_minor(a: str, b: str) -> bool:
    return a.split(".")[:2] == b.split(".")[:2]


def _documented() -> dict[str, dict[str, str]]:
    return read_table(DOCS)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}

    def get(family: str):
        if family not in built:
            try:
                model_dir = build(family, str(tmp_path_factory.mktemp(family)))
            except AttributeError as e:  # an older transformers without the family's config class
                if _same_minor(transformers.__version__, _documented_transformers()):
                    raise
                pytest.skip(f"transformers {transformers.__version__} cannot build {family}: {e}")
            built[family] = model_dir, reference(model_dir)
        return built[family]

    return get


@pytest.mark.parametrize("column", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_COLUMNS else c
                                    for c in COLUMNS])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_column_matches_transformers_or_is_refused_as_documented(models, family, column):
    model_dir, model = models(family)
    result = run_cell(family, column, model_dir, model)  # AssertionError: hsx differs from transformers
    documented = _documented()[family][column]
    if result.startswith("refused") and not documented.startswith("refused") \
            and not _same_minor(transformers.__version__, _documented_transformers()):
        # another transformers than the table's may lack what a column needs: refused in one line, never wrong
        pytest.skip(f"on transformers {transformers.__version__} (the table is {_documented_transformers()}'s): "
                    f"{result}")
    assert result.startswith("refused") == documented.startswith("refused"), (result, documented)
    if result.startswith("refused"):
        assert "\n" not in result and len(result) < 400  # one line that names why


def test_docs_carry_the_matrix_of_exactly_these_families_and_columns_all_passing():
    documented = _documented()
    assert list(documented) == list(FAMILIES)
    assert all(list(row) == list(COLUMNS) for row in documented.values())
    assert not any(cell.startswith("FAILS") for row in documented.values() for cell in row.values())
    passing = [f for f, row in documented.items() if not any(c.startswith("refused") for c in row.values())]
    assert len(passing) >= MATRIX_FAMILIES, passing
    for family in ("gemma2", "gemma3_text", "gpt_oss", "qwen3_next"):  # windows and a hybrid decode losslessly
        assert re.match(r"lossless, \d+/\d+ accepted", documented[family]["eagle3"])
        assert re.match(r"lossless, \d+/\d+ accepted", documented[family]["ngram"])
