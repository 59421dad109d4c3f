"""The import boundaries of README's Layout table, checked over the whole repository with the rules of
tests/boundaries.py: every top-level folder with .py files a row, no edge the table does not allow (imports by AST at
any level, literal import_module/__import__/runpy names, "module:Name" strings), no banned third-party package, no
cycle between rows or modules, no `_private` name taken from another module, no import by a run-time name outside the
named lazy loaders, every pyproject entry point a module of a row, and no drafter family named where a list goes
stale. tests/test_boundary_rules.py shows each rule failing on a scratch tree with one planted offence."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

from tests.boundaries import (
    Row,
    Tree,
    dynamic_imports,
    entry_point_problems,
    families,
    family_names,
    forbidden_edges,
    layout_section,
    layout_table,
    module_cycles,
    private_imports,
    read_tree,
    unlisted_folders,
)

REPO = pathlib.Path(__file__).resolve().parents[1]

LAZY_LOADERS = {
    ("training/__init__.py", "__getattr__"),  # the package's public names, each module imported when first used
    ("training/export/__init__.py", "__getattr__"),  # likewise
    ("extractor/__init__.py", "__getattr__"),  # likewise
    ("connectors/__init__.py", "__getattr__"),  # likewise
    ("connectors/config.py", "get_connector_class"),  # a registered connector's "module:Class"
    ("drafters/registry.py", "load"),  # a family's "module:Class" (its drafter, its proposer)
}
"""The functions that may import a module named at run time, by (path, function). Their names come from strings the
rules read as edges ("module:Name" and "package.module" strings)."""

ALLOWED_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()
"""`_private` names a module may take from another, as (path, module, name): none (the rule takes the list so that
its mutation test can plant one)."""

ALLOWED_MODULE_CYCLES: set[tuple[str, ...]] = set()
"""Module cycles tolerated: none (the rule takes the list so that its mutation test can plant one)."""


@pytest.fixture(scope="module")
def tree() -> Tree:
    return read_tree(REPO)


@pytest.fixture(scope="module")
def rules(tree) -> dict[str, Row]:
    table = layout_table(tree.readme)
    assert {"cli", "serve", "jobs", "training", "drafters", "extractor", "connectors"} <= set(table), table
    assert all(table[name].product for name in ("cli", "connectors")), table
    return table


def all_problems(tree: Tree, rules: dict[str, Row]) -> list[str]:
    return (unlisted_folders(tree, rules) + forbidden_edges(tree, rules)
            + private_imports(tree, rules, ALLOWED_PRIVATE_IMPORTS) + dynamic_imports(tree, rules, LAZY_LOADERS)
            + entry_point_problems(tree, rules) + module_cycles(tree, rules, ALLOWED_MODULE_CYCLES))


def test_every_top_level_folder_with_python_is_a_row(tree, rules):
    assert unlisted_folders(tree, rules) == []


def test_every_package_keeps_to_the_layout_table(tree, rules):
    assert forbidden_edges(tree, rules) == []


def test_no_module_takes_another_modules_private_names(tree, rules):
    assert private_imports(tree, rules, ALLOWED_PRIVATE_IMPORTS) == []


def test_only_the_named_lazy_loaders_import_by_a_run_time_name(tree, rules):
    assert dynamic_imports(tree, rules, LAZY_LOADERS) == []


def test_every_entry_point_names_a_module_of_a_row_below_its_loader(tree, rules):
    assert entry_point_problems(tree, rules) == []


def test_no_modules_import_one_another(tree, rules):
    assert module_cycles(tree, rules, ALLOWED_MODULE_CYCLES) == []


def test_the_layout_table_and_the_description_name_no_drafter_family(tree):
    description = re.search(r"^description\s*=.*$", tree.pyproject, re.M)
    assert description is not None
    names = families(tree.pyproject)
    assert len(names) >= 6, names
    assert family_names({"README.md's Layout section": layout_section(tree.readme),
                         "pyproject.toml's description": description.group()}, names) == []


@pytest.mark.parametrize("path, line, expect", [
    ("training/trainer.py", "from jobs.model import ModelFacts", "training/ may import only"),
    ("jobs/x.py", "def f():\n    from serve.config import ServeConfig", "jobs/ may import only"),
    ("extractor/proposers.py", "import importlib\nm = importlib.import_module('drafters.eagle3')",
     "extractor/ may import only"),
    ("serve/server.py", "from jobs.pipeline import _first_line", "are private to jobs/"),
    ("connectors/x.py", "import transformers", "connectors/ never imports transformers"),
    ("drafters/x.py", "def f():\n    import ray", "drafters/ never imports ray"),
    ("cli/x.py", "import benchmarks.common", "cli/ may import only"),
    ("connectors/x.py", "LOADER = 'training.dataset:HiddenStatesDataset'", "connectors/ may import only"),
    ("jobs/x.py", "import importlib\ndef f(name):\n    return importlib.import_module(name)", "run time"),
    ("hsxutil/x.py", "import cli", "hsxutil/ holds .py files but is no row"),
])
def test_a_forbidden_import_added_back_is_found(tree, rules, path, line, expect):
    planted = Tree(dict(tree.files), tree.pyproject, tree.readme)
    planted.files[path] = planted.files.get(path, "") + "\n" + line + "\n"
    found = all_problems(planted, rules)
    assert any(expect in p for p in found), found


def test_the_table_is_read_from_readme_rows():
    readme = "## Layout\n| package | imports from | never imports | what |\n|---|---|---|---|\n" \
             "| `x/` | y, z | ray | the x |\n| `y/` |  | transformers, ray | the y |\n| `t/` | * | | tests |\n" \
             "## Next\n| `w/` | x | | no |\n"
    assert layout_table(readme) == {"x": Row(frozenset({"y", "z"}), frozenset({"ray"})),
                                     "y": Row(frozenset(), frozenset({"transformers", "ray"})),
                                     "t": Row(None)}


_PRODUCT = sorted(name for name, row in layout_table((REPO / "README.md").read_text()).items() if row.product)


@pytest.mark.parametrize("package", _PRODUCT)
def test_each_package_docstring_lists_the_files_that_exist(package):
    """A package's docstring is its table of contents: every module in it is named there, and every `name.py` it
    names exists (a moved or deleted file cannot linger in the table)."""
    doc = importlib.import_module(package).__doc__ or ""
    folder = REPO / package
    files = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    subpackages = {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    named = set(re.findall(r"(?<![/\w.])(\w+\.py)\b", doc))  # not other packages' cli/jobs.py
    assert files - named == set(), f"{package}/__init__.py does not list {sorted(files - named)}"
    assert {n for n in named if n not in files and not any((folder / d / n).exists() for d in subpackages)} == set()
    assert all(f"{d}/" in doc for d in subpackages), subpackages


MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80


def _sizes(package: str) -> list[str]:
    import ast

    too_big = []
    for path in sorted((REPO / package).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(REPO)
        if text.count("\n") > MAX_FILE_LINES:
            too_big.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_big.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return too_big


@pytest.mark.parametrize("package", _PRODUCT)
def test_no_product_file_over_600_lines_or_function_over_80(package):
    """A module a newcomer reads in one sitting, a function on one screen or two: past these, cut at a seam."""
    assert _sizes(package) == []
