"""The rules of README's Layout table as functions over a tree, so that tests/test_boundaries.py runs them on the
repository and tests/test_boundary_rules.py on scratch trees, each with one planted offence.

    Tree(files, pyproject, readme)   a tree: its .py files (path -> source), pyproject.toml's and README's text
    read_tree(root) -> Tree          a folder's tree (hidden folders, __pycache__, *.egg-info, build/, dist/ and
                                     virtual environments left out)
    layout_table(readme) -> {row: Row}   README's Layout table: a row per top-level folder; `*` = may import anything
    references(path, source, modules) -> [Reference]   every import in a file, read by AST: module and function
                                     level, TYPE_CHECKING, relative, `import_module`/`__import__`/`runpy` calls, and
                                     module-name strings ("jobs.config", "drafters.eagle:FAMILY")
    entry_points(pyproject) -> [(group, name, target)]   [project.scripts] and [project.entry-points.*]

The rules, each (tree, table, ...) -> [problem], empty when the tree keeps to it:
    unlisted_folders      every top-level folder holding a .py file is a row; no .py file at the top
    forbidden_edges       no import the row does not allow, no banned third-party package, no cycle between rows
    private_imports       no `_private` name taken from another module (another package's or a sibling's), by import
                          or by attribute (`pipeline._first_line`)
    dynamic_imports       import_module / __import__ / runpy with a name that is not a literal only in LAZY_LOADERS
                          (each of which must still hold one: the list cannot rot)
    entry_point_problems  every entry point's module exists in a row and defines its object; a plug-in group is
                          an edge from the plug-in's row down to the row that loads the group
    module_cycles         no import cycle between modules (inside a package, which the row rule cannot see)
    family_names          README's Layout table and pyproject's description name no drafter family (a list there
                          goes stale with the next family; the families: pyproject's `hsx.drafters` entry points)

Rows whose "imports from" cell is `*` (benchmarks/, examples/, tests/) may import anything, privates included; every
other rule above reads the product rows only.
"""

from __future__ import annotations

import ast
import functools
import os
import pathlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

ANY = "*"
"""An "imports from" cell that allows every row (benchmarks/, examples/, tests/)."""
FAMILY_GROUP = "hsx.drafters"
"""The entry-point group that lists the drafter families."""
DYNAMIC_CALLS = {"import_module", "__import__", "run_module", "run_path", "spec_from_file_location"}
"""Calls that import a module named at run time (the last two by file path: always dynamic)."""
_BY_NAME = {"import_module", "__import__", "run_module"}
"""Of DYNAMIC_CALLS, those whose first argument is a module name (a literal one is an ordinary edge)."""
_SKIP_DIRS = {"__pycache__", "build", "dist", "node_modules"}
_MODULE_STRING = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?$|^[A-Za-z_]\w*:[A-Za-z_]\w*$")


@dataclass
class Tree:
    files: dict[str, str]
    """Every .py file, by its path from the root ("jobs/config.py")."""
    pyproject: str = ""
    readme: str = ""

    @property
    def modules(self) -> dict[str, str]:
        """Dotted module name -> path ("jobs.config" -> "jobs/config.py", "jobs" -> "jobs/__init__.py")."""
        return {module_name(p): p for p in self.files}


@dataclass(frozen=True)
class Row:
    allowed: frozenset[str] | None
    """Rows it may import (None: any, the table's `*`)."""
    banned: frozenset[str] = frozenset()
    """Third-party packages it must never import."""

    @property
    def product(self) -> bool:
        return self.allowed is not None


@dataclass(frozen=True)
class Reference:
    line: int
    module: str
    """The module named (for a relative import: resolved)."""
    names: tuple[str, ...] = ()
    """The names taken from it (`from module import names`)."""
    how: str = "import"
    """"import", "call" (a literal import_module/__import__/run_module), "string" (a module-name string) or "prefix"
    (the literal start of an f-string given to one of those calls)."""


@dataclass(frozen=True)
class DynamicCall:
    line: int
    call: str
    scope: str
    """The enclosing function's qualified name ("FinalNorm.load", "<module>" at module level)."""


def read_tree(root: str | os.PathLike) -> Tree:
    root = pathlib.Path(root)
    files = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not (d.startswith(".") or d in _SKIP_DIRS or d.endswith(".egg-info")
                                                 or (pathlib.Path(folder, d, "pyvenv.cfg")).exists()))
        for name in names:
            if name.endswith(".py"):
                path = pathlib.Path(folder, name)
                files[path.relative_to(root).as_posix()] = path.read_text(encoding="utf-8")
    text = lambda name: (root / name).read_text(encoding="utf-8") if (root / name).is_file() else ""  # noqa: E731
    return Tree(files, text("pyproject.toml"), text("README.md"))


_ROW = re.compile(r"^\|\s*`(\w+)/`\s*\|([^|]*)\|([^|]*)\|")


def layout_table(readme: str) -> dict[str, Row]:
    """README's Layout table: top-level folder -> Row."""
    section = layout_section(readme)
    words = lambda cell: frozenset(w.strip() for w in cell.split(",") if w.strip())  # noqa: E731
    rules = {}
    for line in section.splitlines():
        m = _ROW.match(line)
        if m:
            allowed = words(m.group(2))
            rules[m.group(1)] = Row(None if ANY in allowed else allowed, words(m.group(3)))
    return rules


def layout_section(readme: str) -> str:
    return readme.split("## Layout", 1)[1].split("\n## ", 1)[0] if "## Layout" in readme else ""


def module_name(path: str) -> str:
    parts = path[:-len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(path: str) -> str:
    """The top-level folder (row) of a path, "" for a file at the top."""
    return path.split("/", 1)[0] if "/" in path else ""


# -- reading a file -------------------------------------------------------------------------------------------------


class _Reader(ast.NodeVisitor):
    """One pass over a file: its references, its dynamic calls, the names its imports bind to modules, and its
    attribute reads on them."""

    def __init__(self, path: str, modules: Iterable[str]) -> None:
        self.path, self.modules = path, set(modules)
        self.here = module_name(path)
        self.package = self.here if path.endswith("__init__.py") else self.here.rpartition(".")[0]
        self.refs: list[Reference] = []
        self.dynamic: list[DynamicCall] = []
        self.bound: dict[str, str] = {}  # local name -> module it names
        self.attributes: list[tuple[int, str, str]] = []  # (line, module, attribute read on it)
        self.callers: dict[str, str] = {}  # local name -> the dynamic call it is (import_module as im)
        self.scope: list[str] = []

    # imports
    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.refs.append(Reference(node.lineno, a.name))
            if a.asname:
                self.bound[a.asname] = a.name
            else:
                self.bound[a.name.split(".")[0]] = a.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level:
            base = self.package.split(".")
            base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            module = ".".join([*base, module] if module else base)
        names = tuple(a.name for a in node.names)
        self.refs.append(Reference(node.lineno, module, names))
        for a in node.names:
            local = a.asname or a.name
            if f"{module}.{a.name}" in self.modules:
                self.bound[local] = f"{module}.{a.name}"
            if module in ("importlib", "runpy", "builtins") and a.name in DYNAMIC_CALLS:
                self.callers[local] = a.name

    # scopes
    def _scoped(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    # dynamic imports
    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else self.callers.get(getattr(func, "id", ""),
                                                                                  getattr(func, "id", None))
        if name in DYNAMIC_CALLS:
            arg = node.args[0] if node.args else None
            if name in _BY_NAME and isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                    and not arg.value.startswith("."):
                self.refs.append(Reference(node.lineno, arg.value, how="call"))
            else:
                self.dynamic.append(DynamicCall(node.lineno, name, ".".join(self.scope) or "<module>"))
                prefix = arg.values[0] if isinstance(arg, ast.JoinedStr) and arg.values else None
                if isinstance(prefix, ast.Constant) and "." in prefix.value:
                    self.refs.append(Reference(node.lineno, prefix.value.split(".")[0], how="prefix"))
        self.generic_visit(node)

    # module-name strings and private attributes
    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and _MODULE_STRING.match(node.value):
            module = node.value.partition(":")[0]
            if module in self.modules:
                self.refs.append(Reference(node.lineno, module, how="string"))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in self.bound:
            module = self.bound[value.id]
            for attr in chain:  # walk down the submodules: jobs.pipeline._first_line
                if f"{module}.{attr}" in self.modules:
                    module = f"{module}.{attr}"
                    continue
                self.attributes.append((node.lineno, module, attr))
                break
            return  # the whole chain is read; do not read its inner attributes again
        self.generic_visit(node)


def read_file(path: str, source: str, modules: Iterable[str]) -> _Reader:
    return _read(path, source, frozenset(modules))


@functools.lru_cache(maxsize=4096)
def _read(path: str, source: str, modules: frozenset[str]) -> _Reader:
    """read_file's work, once per file and tree (a mutation test reads the repository again with one line planted)."""
    reader = _Reader(path, modules)
    reader.visit(_parse(path, source))
    return reader


@functools.lru_cache(maxsize=4096)
def _parse(path: str, source: str) -> ast.Module:
    return ast.parse(source, filename=path)


def references(path: str, source: str, modules: Iterable[str] = ()) -> list[Reference]:
    return read_file(path, source, modules).refs


def _target(ref: Reference, name: str | None, modules: set[str]) -> str:
    """The module a reference reaches: `from a.b import c` reaches a.b.c when that is a module, else a.b."""
    if name is not None and f"{ref.module}.{name}" in modules:
        return f"{ref.module}.{name}"
    return ref.module


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _product_files(tree: Tree, table: dict[str, Row]):
    for path, source in sorted(tree.files.items()):
        row = table.get(package_of(path))
        if row is not None and row.product:
            yield path, source, row


# -- the rules ------------------------------------------------------------------------------------------------------


def unlisted_folders(tree: Tree, table: dict[str, Row]) -> list[str]:
    """Every top-level folder that holds a .py file is a row of the table; no .py file sits at the top."""
    problems = set()
    for path in tree.files:
        package = package_of(path)
        if not package:
            problems.add(f"{path}: a module at the top of the tree belongs to no row; move it into a package")
        elif package not in table:
            problems.add(f"{package}/ holds .py files but is no row of README's Layout table; add its row")
    return sorted(problems)


def forbidden_edges(tree: Tree, table: dict[str, Row]) -> list[str]:
    """Every reference of a product row to a row it may not import, every banned third-party import, and every
    cycle between rows."""
    modules = frozenset(tree.modules)
    problems, edges = [], {name: set() for name in table}
    for path, source, row in _product_files(tree, table):
        package = package_of(path)
        for ref in references(path, source, modules):
            top = ref.module.split(".")[0]
            where = f"{path}:{ref.line} {'imports' if ref.how in ('import', 'call') else 'names'} {ref.module}"
            if top in row.banned:
                problems.append(f"{where}: {package}/ never imports {top}")
            if top not in table or top == package:
                continue
            edges[package].add(top)
            if top not in row.allowed:
                problems.append(f"{where}: {package}/ may import only {sorted(row.allowed) or 'nothing of ours'}")
    return sorted(set(problems + _cycles(edges)))


def private_imports(tree: Tree, table: dict[str, Row], allow: Iterable[tuple[str, str, str]] = ()) -> list[str]:
    """Every `_private` name a product module takes from another module of ours: by import (a private name, or a
    module another package keeps private) or by attribute on a module it imported. `allow`: (path, module, name)
    offences tolerated for now; one that no longer occurs is reported (the list only shrinks)."""
    modules = frozenset(tree.modules)
    allow, seen, problems = set(allow), set(), []
    for path, source, _ in _product_files(tree, table):
        here, package = module_name(path), package_of(path)
        reader = read_file(path, source, modules)
        for ref in reader.refs:
            top = ref.module.split(".")[0]
            if ref.how not in ("import", "call") or top not in table or ref.module == here:
                continue
            private = [n for n in ref.names if _is_private(n) and _target(ref, n, modules) != here]
            if top != package:
                private = [p for p in ref.module.split(".")[1:] if _is_private(p)] + private
            seen |= {(path, ref.module, n) for n in private}
            private = [n for n in private if (path, ref.module, n) not in allow]
            if private:
                owner = f"{top}/" if top != package else ref.module
                problems.append(f"{path}:{ref.line} imports {ref.module}: {private} are private to {owner}; make "
                                "what two modules share public in the lower one")
        for line, module, attr in reader.attributes:
            if module != here and _is_private(attr) and module.split(".")[0] in table:
                seen.add((path, module, attr))
                if (path, module, attr) not in allow:
                    problems.append(f"{path}:{line} reads {module}.{attr}: {attr} is private to {module}")
    problems += [f"{path} no longer takes {module}.{name}: take it off the allowed private imports"
                 for path, module, name in sorted(allow - seen)]
    return sorted(set(problems))


def dynamic_imports(tree: Tree, table: dict[str, Row], loaders: Iterable[tuple[str, str]]) -> list[str]:
    """Every import by a run-time name (import_module / __import__ / runpy) in a product row outside `loaders`
    ((path, function) pairs: the named lazy loaders), and every loader that no longer holds one."""
    loaders, modules = set(loaders), frozenset(tree.modules)
    used, problems = set(), []
    for path, source, _ in _product_files(tree, table):
        for call in read_file(path, source, modules).dynamic:
            if (path, call.scope) in loaders:
                used.add((path, call.scope))
            else:
                problems.append(f"{path}:{call.line} {call.call}() in {call.scope} imports a module named at run "
                                "time, which no boundary check can read; import it by name, or name this function "
                                "among the lazy loaders")
    problems += [f"{path}: {scope} is a named lazy loader but imports nothing by a run-time name; take it off the "
                 "list" for path, scope in sorted(loaders - used)]
    return sorted(problems)


_SECTION = re.compile(r'^\[project\.(scripts|entry-points\."?([\w.-]+)"?)\]\s*$')


def entry_points(pyproject: str) -> list[tuple[str, str, str]]:
    """(group, name, "module:object") for [project.scripts] (group "console_scripts") and every
    [project.entry-points.GROUP] of pyproject.toml's text."""
    found, group = [], None
    for line in pyproject.splitlines():
        if line.startswith("["):
            m = _SECTION.match(line.strip())
            group = (m.group(2) or "console_scripts") if m else None
            continue
        m = re.match(r'^\s*"?([\w.-]+)"?\s*=\s*"([^"]+)"', line)
        if group and m:
            found.append((group, m.group(1), m.group(2)))
    return found


def entry_point_problems(tree: Tree, table: dict[str, Row]) -> list[str]:
    """Every entry point names a module of a row that defines its object at the top level; a plug-in group
    (any group but console_scripts) is loaded by a product module that holds the group's name as a string, and the
    plug-in's row may import that module's row: the plug-in is the edge, pointing down to its loader."""
    modules = tree.modules
    problems = []
    product = list(_product_files(tree, table))
    for group, name, target in entry_points(tree.pyproject):
        where = f"pyproject.toml [{group}] {name} = {target!r}"
        module, _, obj = target.partition(":")
        row = table.get(module.split(".")[0])
        if row is None:
            problems.append(f"{where}: {module.split('.')[0]}/ is no row of README's Layout table")
            continue
        if module not in modules:
            problems.append(f"{where}: no module {module} in the tree")
            continue
        defined = _top_level_names(tree.files[modules[module]])
        if obj and obj.split(".")[0] not in defined:
            problems.append(f"{where}: {module} defines no {obj.split('.')[0]} at its top level")
        if group == "console_scripts":
            continue
        loaders = sorted({package_of(path) for path, source, _ in product if group in _strings(source)})
        if not loaders:
            problems.append(f"{where}: no module of ours loads the group {group!r}")
        for loader in loaders:
            plugin = module.split(".")[0]
            if plugin != loader and (row.allowed is not None and loader not in row.allowed):
                problems.append(f"{where}: {loader}/ loads {group!r}, so {plugin}/ plugs into {loader}/, but "
                                f"{plugin}/ may import only {sorted(row.allowed)}")
    return sorted(problems)


def module_cycles(tree: Tree, table: dict[str, Row], allow: Iterable[tuple[str, ...]] = ()) -> list[str]:
    """Every import cycle between product modules (each import counts, deferred and TYPE_CHECKING ones too; a
    "module:Name" string a registry resolves when used does not): a module that needs a type from one that needs it
    back shares a lower module both import. `allow`: cycles (their modules, sorted) tolerated for now; one that no
    longer occurs is reported."""
    modules = frozenset(tree.modules)
    graph: dict[str, set[str]] = {}
    for path, source, _ in _product_files(tree, table):
        here = module_name(path)
        graph[here] = set()
        for ref in references(path, source, modules):
            if ref.how == "string":
                continue
            for name in ref.names or (None,):
                target = _target(ref, name, modules)
                if target in modules and target != here:
                    graph[here].add(target)
    cycles = {tuple(c) for c in _strongly_connected(graph) if len(c) > 1}
    allow = {tuple(sorted(c)) for c in allow}
    return [f"module cycle: {', '.join(c)} import one another (directly or through each other)"
            for c in sorted(cycles - allow)] + \
        [f"module cycle {' / '.join(c)} is gone: take it off the allowed cycles" for c in sorted(allow - cycles)]


def families(pyproject: str) -> list[str]:
    return [name for group, name, _ in entry_points(pyproject) if group == FAMILY_GROUP]


_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_-]*[A-Za-z0-9]")


def family_names(texts: dict[str, str], names: Iterable[str]) -> list[str]:
    """Every drafter family `texts` (where -> text) name, in any spelling ("EAGLE-3" for eagle3, "MLPSpeculator"
    for mlp_speculator: compared without case, '-' or '_'). For the texts that must never enumerate the families
    (README's Layout table, pyproject's description): a list there goes stale with the next family."""
    key = lambda word: re.sub(r"[-_]", "", word).lower()  # noqa: E731
    wanted = {key(n) for n in names}
    problems = []
    for where, text in texts.items():
        for m in _WORD.finditer(text):
            if key(m.group()) in wanted:
                problems.append(f"{where}:{text.count(chr(10), 0, m.start()) + 1}: names the drafter family "
                                f"{m.group()!r}; say 'the drafter families' (they come from the registry) instead "
                                "of listing them")
    return problems


# -- helpers --------------------------------------------------------------------------------------------------------


def _top_level_names(source: str) -> set[str]:
    names = set()
    for node in _parse("", source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@functools.lru_cache(maxsize=4096)
def _strings(source: str) -> frozenset[str]:
    return frozenset(n.value for n in ast.walk(_parse("", source))
                     if isinstance(n, ast.Constant) and isinstance(n.value, str))


def _cycles(edges: dict[str, set[str]]) -> list[str]:
    """Each cycle between rows, from each row it passes through ("cycle: a -> b -> a" and "cycle: b -> a -> b")."""
    problems = []
    for start in edges:
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    problems.append("cycle: " + " -> ".join([*trail, start]))
                elif nxt not in trail:
                    stack.append((nxt, [*trail, nxt]))
    return problems


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)
