"""The import boundaries of README's Layout table, checked over every package: imports read by AST (module level,
function level, `importlib.import_module("...")` string literals), no edge the table does not allow, no import of
another package's `_private` names, no third-party package a floor must not import, and no cycle."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
_ROW = re.compile(r"^\|\s*`(\w+)/`\s*\|([^|]*)\|([^|]*)\|")


def layout_table(readme: str) -> dict[str, tuple[set[str], set[str]]]:
    """README's Layout table: package -> (packages it may import, third-party packages it must not)."""
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rules = {}
    for line in section.splitlines():
        m = _ROW.match(line)
        if m:
            words = lambda cell: {w.strip() for w in cell.split(",") if w.strip()}  # noqa: E731
            rules[m.group(1)] = (words(m.group(2)), words(m.group(3)))
    return rules


def imports_of(source: str) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, module, names imported from it) for every import in `source`, wherever it sits."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, tuple(a.name for a in node.names)))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) ==
              "import_module" and node.args and isinstance(node.args[0], ast.Constant) and
              isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value, ()))
    return found


def violations(files: dict[str, str], rules: dict[str, tuple[set[str], set[str]]]) -> list[str]:
    """Every import in `files` (path -> source, paths starting with their package) that breaks `rules`, and every
    cycle between packages."""
    problems, edges = [], {name: set() for name in rules}
    for path, source in sorted(files.items()):
        package = path.split("/", 1)[0]
        if package not in rules:
            continue
        allowed, banned = rules[package]
        for line, module, names in imports_of(source):
            top = module.split(".")[0]
            where = f"{path}:{line} imports {module}"
            if top in banned:
                problems.append(f"{where}: {package}/ never imports {top}")
            if top not in rules or top == package:
                continue
            edges[package].add(top)
            if top not in allowed:
                problems.append(f"{where}: {package}/ may import only {sorted(allowed) or 'nothing of ours'}")
            private = [n for n in (*module.split(".")[1:], *names) if n.startswith("_") and not n.startswith("__")]
            if private:
                problems.append(f"{where}: {private} are private to {top}/")
    for start in edges:  # a cycle: a path that leads back to where it began
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    problems.append("cycle: " + " -> ".join([*trail, start]))
                elif nxt not in trail:
                    stack.append((nxt, [*trail, nxt]))
    return sorted(set(problems))


@pytest.fixture(scope="module")
def rules():
    table = layout_table((REPO / "README.md").read_text())
    assert set(table) == {"cli", "serve", "jobs", "training", "drafters", "extractor", "connectors"}, table
    return table


def _tree(rules) -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for name in rules for p in (REPO / name).rglob("*.py")}


def test_every_package_keeps_to_the_layout_table(rules):
    assert violations(_tree(rules), rules) == []


@pytest.mark.parametrize("path, line, expect", [
    ("training/trainer.py", "from jobs.model import ModelFacts", "training/ may import only"),
    ("jobs/x.py", "def f():\n    from serve.config import ServeConfig", "jobs/ may import only"),
    ("extractor/proposers.py", "import importlib\nm = importlib.import_module('drafters.eagle3')",
     "extractor/ may import only"),
    ("serve/server.py", "from jobs.pipeline import _first_line", "are private to jobs/"),
    ("connectors/x.py", "import transformers", "connectors/ never imports transformers"),
    ("drafters/x.py", "def f():\n    import ray", "drafters/ never imports ray"),
])
def test_a_forbidden_import_added_back_is_found(rules, path, line, expect):
    tree = _tree(rules)
    tree[path] = tree.get(path, "") + "\n" + line + "\n"
    found = violations(tree, rules)
    assert any(expect in p for p in found), found


def test_a_cycle_is_found_even_where_the_table_allowed_both_edges():
    rules = {"a": ({"b"}, set()), "b": ({"a"}, set())}
    found = violations({"a/m.py": "import b.x", "b/m.py": "from a.m import y"}, rules)
    assert "cycle: a -> b -> a" in found and "cycle: b -> a -> b" in found


def test_the_table_is_read_from_readme_rows():
    readme = "## Layout\n| package | imports from | never imports | what |\n|---|---|---|---|\n" \
             "| `x/` | y, z | ray | the x |\n| `y/` |  | transformers, ray | the y |\n## Next\n| `w/` | x | | no |\n"
    assert layout_table(readme) == {"x": ({"y", "z"}, {"ray"}), "y": (set(), {"transformers", "ray"})}


@pytest.mark.parametrize("package", ["cli", "serve", "jobs", "training", "drafters", "extractor", "connectors"])
def test_each_package_docstring_lists_the_files_that_exist(package):
    """A package's docstring is its table of contents: every module in it is named there, and every `name.py` it
    names exists (a moved or deleted file cannot linger in the table)."""
    import importlib

    doc = importlib.import_module(package).__doc__ or ""
    folder = REPO / package
    files = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    subpackages = {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    named = set(re.findall(r"(?<![/\w.])(\w+\.py)\b", doc))  # not other packages' cli/jobs.py
    assert files - named == set(), f"{package}/__init__.py does not list {sorted(files - named)}"
    assert {n for n in named if n not in files and not any((folder / d / n).exists() for d in subpackages)} == set()
    assert all(f"{d}/" in doc for d in subpackages), subpackages
