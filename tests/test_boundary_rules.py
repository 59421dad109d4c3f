"""Each rule of tests/boundaries.py on a scratch tree (tmp_path): the clean tree passes every rule, and the same tree
with one planted offence fails the rule that owns it, with a message naming the offence."""

from __future__ import annotations

import pytest

from tests.boundaries import (
    Tree,
    dynamic_imports,
    entry_point_problems,
    entry_points,
    family_names,
    forbidden_edges,
    layout_table,
    module_cycles,
    private_imports,
    read_tree,
    references,
    unlisted_folders,
)

README = """# scratch
## Layout
| package | imports from | never imports | what it is |
|---|---|---|---|
| `top/` | low | | the top floor |
| `low/` | | ray | the bottom floor |
| `tests/` | * | | anything goes |

## Next
"""

PYPROJECT = """[project]
name = "scratch"
description = "a scratch tree"

[project.scripts]
scratch = "top.main:main"

[project.entry-points."scratch.plugins"]
one = "top.plugin:PLUGIN"

[tool.other]
key = "value"
"""

CLEAN = {
    "top/__init__.py": '"""The top floor."""\n',
    "top/main.py": "from low.base import Thing\n\n\ndef main():\n    return Thing()\n",
    "top/plugin.py": "from low.registry import GROUP\n\nPLUGIN = GROUP\n",
    "low/__init__.py": '"""The bottom floor."""\n',
    "low/base.py": "class Thing:\n    pass\n\n\ndef _helper():\n    return 1\n\n\ndef helper():\n    return _helper()\n",
    "low/registry.py": ('import importlib\n\nGROUP = "scratch.plugins"\n\n\ndef load(ref):\n'
                        '    module, _, name = ref.partition(":")\n    return getattr(importlib.import_module(module), name)\n'),
    "low/sub/__init__.py": "",
    "low/sub/leaf.py": "from ..base import helper\n\nVALUE = helper()\n",
    "tests/test_top.py": ("import importlib\n\nfrom low.base import _helper\nfrom top.main import main\n\n\n"
                          "def test_it(name='top.main'):\n    assert importlib.import_module(name).main() and _helper()\n"),
}
LOADERS = {("low/registry.py", "load")}


def scratch(tmp_path, plant: dict[str, str] | None = None, pyproject: str = PYPROJECT, readme: str = README) -> Tree:
    """The clean scratch tree written under tmp_path, with `plant` (path -> lines) appended to its files, read back."""
    files = dict(CLEAN)
    for path, lines in (plant or {}).items():
        files[path] = files.get(path, "") + "\n" + lines + "\n"
    for path, source in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    (tmp_path / "pyproject.toml").write_text(pyproject)
    (tmp_path / "README.md").write_text(readme)
    return read_tree(tmp_path)


def every_rule(tree: Tree, loaders=LOADERS) -> list[str]:
    table = layout_table(tree.readme)
    return (unlisted_folders(tree, table) + forbidden_edges(tree, table) + private_imports(tree, table)
            + dynamic_imports(tree, table, loaders) + entry_point_problems(tree, table) + module_cycles(tree, table))


def test_the_clean_scratch_tree_passes_every_rule(tmp_path):
    tree = scratch(tmp_path)
    assert set(tree.files) == set(CLEAN)
    assert every_rule(tree) == []


def test_hidden_folders_caches_and_virtual_environments_are_not_read(tmp_path):
    for path in (".venv/lib/x.py", "top/__pycache__/x.py", "hsx.egg-info/x.py", "build/lib/x.py", "env/x.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("import cli\n")
    (tmp_path / "env" / "pyvenv.cfg").write_text("home = /usr\n")
    assert every_rule(scratch(tmp_path)) == []


# -- every top-level folder with .py files is a row -----------------------------------------------------------------

@pytest.mark.parametrize("path, expect", [
    ("tools/x.py", "tools/ holds .py files but is no row"),
    ("tools/deep/er/x.py", "tools/ holds .py files but is no row"),
    ("setup.py", "setup.py: a module at the top of the tree belongs to no row"),
])
def test_a_folder_the_table_does_not_list_is_found(tmp_path, path, expect):
    tree = scratch(tmp_path, {path: "import top.main"})
    found = unlisted_folders(tree, layout_table(tree.readme))
    assert any(expect in p for p in found), found


# -- edges between rows ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("planted, expect", [
    ("from top.main import main", "low/x.py:2 imports top.main: low/ may import only nothing of ours"),
    ("import top", "imports top: low/ may import only"),
    ("def f():\n    from top.main import main", "low/x.py:3 imports top.main: low/ may import only"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from top.main import main", "imports top.main"),
    ("import importlib\nimportlib.import_module('top.main')", "imports top.main: low/ may import only"),
    ("from importlib import import_module as im\nim('top.main')", "imports top.main: low/ may import only"),
    ("__import__('top.main')", "imports top.main: low/ may import only"),
    ("import runpy\nrunpy.run_module('top.main')", "imports top.main: low/ may import only"),
    ("TARGET = 'top.plugin:PLUGIN'", "names top.plugin: low/ may import only"),
    ("TARGET = 'top.main'", "names top.main: low/ may import only"),
    ("import ray", "low/ never imports ray"),
    ("def f():\n    import ray.data", "low/ never imports ray"),
    ("import importlib\ndef f(x):\n    importlib.import_module(f'ray.{x}')", "low/ never imports ray"),
    ("import tests.test_top", "low/ may import only"),
])
def test_a_forbidden_edge_is_found(tmp_path, planted, expect):
    tree = scratch(tmp_path, {"low/x.py": planted})
    found = forbidden_edges(tree, layout_table(tree.readme))
    assert any(expect in p for p in found), found


def test_a_row_that_may_import_anything_may_not_be_imported_by_a_product_row(tmp_path):
    tree = scratch(tmp_path, {"top/x.py": "from tests.test_top import test_it"})
    found = forbidden_edges(tree, layout_table(tree.readme))
    assert found == ["top/x.py:2 imports tests.test_top: top/ may import only ['low']"], found


def test_a_cycle_is_found_even_where_the_table_allowed_both_edges(tmp_path):
    readme = README.replace("| `low/` | |", "| `low/` | top |")
    tree = scratch(tmp_path, {"low/x.py": "import top.main"}, readme=readme)
    found = forbidden_edges(tree, layout_table(tree.readme))
    assert "cycle: low -> top -> low" in found and "cycle: top -> low -> top" in found, found


def test_a_plain_string_or_a_docstring_naming_a_module_is_no_edge(tmp_path):
    planted = '"""Read top.main for the rest."""\nNOTE = "see top.main"\nWORD = "top"\nOTHER = "not.ours:X"'
    tree = scratch(tmp_path, {"low/x.py": planted})
    assert forbidden_edges(tree, layout_table(tree.readme)) == []


# -- privates -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, planted, expect", [
    ("top/x.py", "from low.base import _helper", "top/x.py:2 imports low.base: ['_helper'] are private to low/"),
    ("top/x.py", "from low._impl import thing", "['_impl'] are private to low/"),
    ("low/x.py", "from low.base import _helper", "['_helper'] are private to low.base"),
    ("low/x.py", "from .base import Thing, _helper", "low/x.py:2 imports low.base: ['_helper'] are private"),
    ("low/sub/x.py", "from .. import base\nbase._helper()", "low/sub/x.py:3 reads low.base._helper"),
    ("low/x.py", "from low import base\nbase._helper()", "low/x.py:3 reads low.base._helper"),
    ("top/x.py", "import low.base\nlow.base._helper()", "top/x.py:3 reads low.base._helper"),
    ("top/x.py", "import low.base as b\nprint(b._helper)", "reads low.base._helper"),
    ("top/x.py", "def f():\n    from low.base import _helper", "top/x.py:3 imports low.base"),
])
def test_a_private_name_taken_from_another_module_is_found(tmp_path, path, planted, expect):
    tree = scratch(tmp_path, {path: planted})
    found = private_imports(tree, layout_table(tree.readme))
    assert any(expect in p for p in found), found


def test_a_module_may_use_its_own_privates_and_dunders_of_others(tmp_path):
    planted = "from low.base import __doc__\nimport low.base\nprint(low.base.__name__)\n_mine = 1\nprint(_mine)"
    tree = scratch(tmp_path, {"low/x.py": planted})
    assert private_imports(tree, layout_table(tree.readme)) == []


def test_allowed_private_imports_are_tolerated_and_a_stale_one_is_reported(tmp_path):
    tree = scratch(tmp_path, {"top/x.py": "from low.base import _helper"})
    table = layout_table(tree.readme)
    assert private_imports(tree, table, {("top/x.py", "low.base", "_helper")}) == []
    found = private_imports(tree, table, {("top/x.py", "low.base", "_helper"), ("top/y.py", "low.base", "_gone")})
    assert found == ["top/y.py no longer takes low.base._gone: take it off the allowed private imports"], found


# -- imports by a run-time name -------------------------------------------------------------------------------------

@pytest.mark.parametrize("planted, expect", [
    ("import importlib\ndef f(name):\n    return importlib.import_module(name)", "low/x.py:4 import_module() in f"),
    ("import importlib\ndef f(x):\n    return importlib.import_module(f'low.{x}')", "import_module() in f"),
    ("from importlib import import_module\nclass C:\n    def m(self, n):\n        return import_module(n)",
     "import_module() in C.m"),
    ("NAME = 'low.base'\nmodule = __import__(NAME)", "low/x.py:3 __import__() in <module>"),
    ("import runpy\nrunpy.run_path('low/base.py')", "run_path() in <module>"),
    ("import runpy\ndef f(n):\n    runpy.run_module(n)", "run_module() in f"),
    ("import importlib.util\nimportlib.util.spec_from_file_location('m', 'low/base.py')",
     "spec_from_file_location() in <module>"),
    ("import importlib\nimportlib.import_module('.base', 'low')", "import_module() in <module>"),
])
def test_an_import_by_a_run_time_name_outside_the_loaders_is_found(tmp_path, planted, expect):
    tree = scratch(tmp_path, {"low/x.py": planted})
    found = dynamic_imports(tree, layout_table(tree.readme), LOADERS)
    assert any(expect in p and "imports a module named at run time" in p for p in found), found


def test_a_lazy_loader_that_no_longer_imports_is_reported(tmp_path):
    tree = scratch(tmp_path)
    found = dynamic_imports(tree, layout_table(tree.readme), {*LOADERS, ("low/base.py", "helper")})
    assert found == ["low/base.py: helper is a named lazy loader but imports nothing by a run-time name; take it off "
                     "the list"], found


def test_a_named_loader_is_exempt_only_in_its_own_function(tmp_path):
    planted = "def other(ref):\n    return importlib.import_module(ref)"
    tree = scratch(tmp_path, {"low/registry.py": planted})
    found = dynamic_imports(tree, layout_table(tree.readme), LOADERS)
    assert found == ["low/registry.py:11 import_module() in other imports a module named at run time, which no "
                     "boundary check can read; import it by name, or name this function among the lazy loaders"]


# -- entry points ---------------------------------------------------------------------------------------------------

def test_entry_points_are_read_from_scripts_and_every_group():
    assert entry_points(PYPROJECT) == [("console_scripts", "scratch", "top.main:main"),
                                       ("scratch.plugins", "one", "top.plugin:PLUGIN")]


@pytest.mark.parametrize("old, new, expect", [
    ('scratch = "top.main:main"', 'scratch = "top.gone:main"', "no module top.gone in the tree"),
    ('scratch = "top.main:main"', 'scratch = "tools.cli:main"', "tools/ is no row of README's Layout table"),
    ('one = "top.plugin:PLUGIN"', 'one = "top.plugin:NOPE"', "top.plugin defines no NOPE at its top level"),
    ('one = "top.plugin:PLUGIN"', 'one = "top.plugin:PLUGIN"\n\n[project.entry-points."nobody.loads"]\n'
                                  'two = "top.plugin:PLUGIN"', "no module of ours loads the group 'nobody.loads'"),
])
def test_a_bad_entry_point_is_found(tmp_path, old, new, expect):
    tree = scratch(tmp_path, pyproject=PYPROJECT.replace(old, new))
    found = entry_point_problems(tree, layout_table(tree.readme))
    assert any(expect in p for p in found), found


def test_a_plug_in_below_the_row_that_loads_its_group_is_found(tmp_path):
    pyproject = PYPROJECT + '\n[project.entry-points."scratch.up"]\nlow_one = "low.base:Thing"\n'
    tree = scratch(tmp_path, {"top/main.py": 'GROUP = "scratch.up"'}, pyproject=pyproject)
    found = entry_point_problems(tree, layout_table(tree.readme))
    assert found == ["pyproject.toml [scratch.up] low_one = 'low.base:Thing': top/ loads 'scratch.up', so low/ "
                     "plugs into top/, but low/ may import only []"], found


# -- module cycles --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("a, b", [
    ("from low.b import y\nx = 1", "from low.a import x\ny = 1"),
    ("from low.b import y\nx = 1", "def f():\n    from low.a import x"),
    ("from low import b\nx = 1", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from low.a import x"),
    ("from .b import y\nx = 1", "import low.a\ny = 1"),
])
def test_a_cycle_between_two_modules_of_a_package_is_found(tmp_path, a, b):
    tree = scratch(tmp_path, {"low/a.py": a, "low/b.py": b})
    found = module_cycles(tree, layout_table(tree.readme))
    assert found == ["module cycle: low.a, low.b import one another (directly or through each other)"], found


def test_a_longer_module_cycle_is_found_once(tmp_path):
    tree = scratch(tmp_path, {"low/a.py": "import low.b", "low/b.py": "import low.c", "low/c.py": "import low.a"})
    found = module_cycles(tree, layout_table(tree.readme))
    assert found == ["module cycle: low.a, low.b, low.c import one another (directly or through each other)"]


def test_a_registry_string_is_no_module_cycle(tmp_path):
    tree = scratch(tmp_path, {"low/a.py": "PROPOSER = 'low.b:Proposer'", "low/b.py": "import low.a\nProposer = 1"})
    assert module_cycles(tree, layout_table(tree.readme)) == []


def test_an_allowed_module_cycle_is_tolerated_and_a_gone_one_is_reported(tmp_path):
    tree = scratch(tmp_path, {"low/a.py": "import low.b", "low/b.py": "import low.a"})
    table = layout_table(tree.readme)
    assert module_cycles(tree, table, {("low.b", "low.a")}) == []
    assert module_cycles(scratch(tmp_path / "clean"), table, {("low.a", "low.b")}) == [
        "module cycle low.a / low.b is gone: take it off the allowed cycles"]


# -- family lists ---------------------------------------------------------------------------------------------------

def test_a_drafter_family_named_in_any_spelling_is_found():
    names = ["eagle3", "medusa", "mlp_speculator", "peagle"]
    text = "one module per family\n(EAGLE-3, Medusa, MLPSpeculator, P-EAGLE)\neagles and medusas are not families"
    found = family_names({"README": text}, names)
    assert [p.split(": ", 1)[1].split(";")[0] for p in found] == ["names the drafter family 'EAGLE-3'",
                                                 "names the drafter family 'Medusa'",
                                                 "names the drafter family 'MLPSpeculator'",
                                                 "names the drafter family 'P-EAGLE'"], found
    assert all(p.startswith("README:2: ") for p in found), found
    assert family_names({"README": "the drafter families, from the registry"}, names) == []


def test_references_resolve_relative_imports_from_a_package_and_a_module():
    assert [r.module for r in references("low/sub/__init__.py", "from . import leaf\nfrom .. import base")] == [
        "low.sub", "low"]
    assert [r.module for r in references("low/sub/leaf.py", "from .x import y\nfrom ..base import z")] == [
        "low.sub.x", "low.base"]
