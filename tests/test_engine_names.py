"""The engine is a seam, not a string: no product module compares an engine's name with a literal (`config.engine ==
"vllm"`, `engine in ("hsx", "vllm")`, `case "vllm":`) outside the engine registry (extractor/engines.py). What differs
between engines is asked of their kind (extractor.engines.EngineKind). Read by AST over README's product rows; the
planted cases show the check finding each form."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
REGISTRY = {"extractor/engines.py"}
"""The one module that may compare an engine's name with a literal."""


def product_packages(readme: str) -> list[str]:
    """The packages of README's Layout table whose row is not `*` (tests, benchmarks, examples)."""
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return sorted(name for name, imports in re.findall(r"^\| `(\w+)/` \| ([^|]*)\|", section, re.M)
                  if imports.strip() != "*")


_ENGINE_NAME = re.compile(r"(^|_)engine(_kind|_name)?$", re.I)
"""Identifiers that hold an engine's name: engine, config.engine, settings.engine_kind, engine_name."""


def _names_an_engine(node: ast.AST) -> bool:
    """An expression holding an engine's name: `engine`, `config.engine`, `settings.engine_kind`, `kind.name`."""
    if isinstance(node, ast.Name):
        return bool(_ENGINE_NAME.search(node.id))
    if isinstance(node, ast.Attribute):
        if node.attr == "name":
            return bool(re.search(r"engine|kind", ast.unparse(node.value), re.I))
        return bool(_ENGINE_NAME.search(node.attr))
    return False


def _literal(node: ast.AST) -> bool:
    """A string literal, or a tuple / list / set of them (the right side of `in`)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_literal(e) for e in node.elts)


def engine_name_comparisons(path: str, source: str) -> list[str]:
    """`path:line: code` for each comparison of an engine's name with a string literal in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_names_an_engine(o) for o in operands) and any(_literal(o) for o in operands):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Match) and _names_an_engine(node.subject):
            for case in node.cases:
                values = [p for p in ast.walk(case.pattern) if isinstance(p, ast.MatchValue)]
                if any(_literal(v.value) for v in values):
                    found.append(f"{path}:{case.pattern.lineno}: case {ast.unparse(case.pattern)}")
    return found


def test_no_product_module_compares_an_engine_name_with_a_literal():
    packages = product_packages((REPO / "README.md").read_text())
    assert {"cli", "serve", "jobs", "training", "extractor", "vllm_engine"} <= set(packages), packages
    found = []
    for package in packages:
        for file in sorted((REPO / package).rglob("*.py")):
            rel = file.relative_to(REPO).as_posix()
            if rel not in REGISTRY:
                found += engine_name_comparisons(rel, file.read_text())
    assert found == [], "ask the engine's kind (extractor.engines) instead:\n" + "\n".join(found)


@pytest.mark.parametrize("planted", [
    'if config.engine == "vllm":\n    pass',
    'if "hsx" != args.engine:\n    pass',
    'ok = s.engine_kind in ("hsx", "vllm")',
    'ok = engine not in {"vllm"}',
    'ok = config.engine_kind().name == "vllm"',
    'match self.engine:\n    case "vllm":\n        pass',
])
def test_a_planted_comparison_is_found(planted):
    assert len(engine_name_comparisons("jobs/x.py", planted)) == 1


@pytest.mark.parametrize("fine", [
    "if config.engine_kind().checks_model:\n    pass",
    'raise ValueError(f"--engine {config.engine}: missing")',
    'ok = config.engine_target == ""',
    'if layout == "online":\n    pass',
])
def test_what_asks_the_kind_or_compares_other_values_is_not_reported(fine):
    assert engine_name_comparisons("jobs/x.py", fine) == []
