"""Plug-ins found through entry points, the way vLLM loads its plugins: the drafter families (extractor.methods,
`hsx.drafters`) and the engine kinds (extractor.engines, `hsx.engines`).

    declared(group) -> [EntryPoint]              the group's installed entry points, then those this source tree's
                                                 pyproject.toml declares under other names
    load_entry_point(ep, what, protocol) -> object
                                                 one loaded; ValueError in one line when it fails to load or is not
                                                 a `protocol` named as its entry point
    load_group(group, what, protocol) -> {name: object}
                                                 each loaded; one that fails is logged and skipped

Run from a source tree that is not installed (PYTHONPATH, as benchmarks/gpu_check.sh does) or installed before a
plug-in was added, the installed metadata lacks some of hsx's own entry points: those declared in the tree's
pyproject.toml are read from it too.
"""

from __future__ import annotations

import logging
import os
import re
from importlib.metadata import EntryPoint, entry_points
from typing import Any

logger = logging.getLogger(__name__)

PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")


def source_tree_entry_points(group: str, pyproject: str = PYPROJECT) -> list[EntryPoint]:
    """The group's entry points as this source tree's pyproject.toml declares them ([] when there is none)."""
    try:
        with open(pyproject, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return []
    header = re.escape(f'[project.entry-points."{group}"]')
    section = re.search(rf'^{header}\s*$(.*?)(?=^\[|\Z)', text, re.M | re.S)
    if section is None:
        return []
    return [EntryPoint(name, value, group)
            for name, value in re.findall(r'^\s*([\w-]+)\s*=\s*"([^"]+)"', section.group(1), re.M)]


def declared(group: str) -> list[EntryPoint]:
    """The installed entry points of `group`, then the source tree's of names not installed."""
    installed = list(entry_points(group=group))
    known = {ep.name for ep in installed}
    return installed + [ep for ep in source_tree_entry_points(group) if ep.name not in known]


def load_entry_point(ep: EntryPoint, what: str, protocol: type) -> Any:
    """The object `ep` names, which must be a `protocol` (a runtime-checkable Protocol) whose `.name` is the entry
    point's; ValueError in one line (`what` names it: "drafter family") otherwise."""
    try:
        obj = ep.load()
    except Exception as e:  # a plug-in's own import failing: say which and why
        raise ValueError(f"{what} {ep.name!r} ({ep.value}) could not be loaded: {type(e).__name__}: {e}") from e
    if not isinstance(obj, protocol) or getattr(obj, "name", None) != ep.name:
        raise ValueError(f"entry point {ep.name!r} ({ep.value}) of {ep.group!r} is no {what} named {ep.name!r}")
    return obj


def load_group(group: str, what: str, protocol: type) -> dict[str, Any]:
    """name -> object of every entry point of `group` that load_entry_point takes; the others are logged and
    skipped, so a broken plug-in cannot take the others down."""
    found: dict[str, Any] = {}
    for ep in declared(group):
        try:
            found.setdefault(ep.name, load_entry_point(ep, what, protocol))
        except ValueError as e:
            logger.warning("%s; ignored", e)
    return found
