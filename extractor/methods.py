"""The speculative methods whose draft is a trained head (the drafter families): one registry, which
the drafters package fills, so the engine finds a proposer without naming a package above it.

    DrafterMethod         what the engine needs of a drafter family (a Protocol; drafters.registry.Family is one)
    register(family)      add a family (a test may add its own); replaces one of the same name
    unregister(name)      take a registered family out again (an installed one comes back)
    families()            name -> family: every `hsx.drafters` entry point, loaded the first time, plus registered ones
    family(name)          one, or None
    ENTRY_POINT_GROUP     "hsx.drafters": `name = "module:OBJECT"` in a package's pyproject, the way vLLM loads its
                          plugins; hsx's own families are declared in its pyproject.toml (extractor.plugins also
                          reads them from a source tree that is not installed)
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, runtime_checkable

from extractor.plugins import load_group

ENTRY_POINT_GROUP = "hsx.drafters"


@runtime_checkable
class DrafterMethod(Protocol):
    name: str
    """The speculative_config "method" (and `hsx train-drafter --kind`)."""
    description: str
    """What its checkpoint is, for messages: "an EAGLE-3 (speculators) checkpoint"."""

    def matches(self, checkpoint_config: dict[str, Any]) -> bool:
        """Whether a checkpoint's config.json is this family's (to infer `method` as vLLM does)."""

    def num_speculative_tokens(self, checkpoint_config: dict[str, Any]) -> int | None:
        """The k the checkpoint was built for, when its config says."""

    def proposer(self, model_dir: str, runner, k: int):
        """The extractor.proposers.Proposer drafting with the checkpoint in `model_dir` for the target in `runner`."""


_lock = threading.Lock()
_families: dict[str, DrafterMethod] = {}
_registered: dict[str, DrafterMethod] = {}
_loaded = False


def register(family: DrafterMethod) -> None:
    """Add `family` (after the entry points, so a registered family wins over an installed one of the same name)."""
    if not isinstance(family, DrafterMethod):
        raise TypeError(f"{family!r} is not a drafter family: it needs name, description, matches(), "
                        "num_speculative_tokens() and proposer() (see drafters.registry.Family)")
    with _lock:
        _registered[family.name] = family
        _families[family.name] = family


def unregister(name: str) -> None:
    """Remove a family `register` added; the installed entry point of that name, if any, is found again."""
    global _loaded
    with _lock:
        _registered.pop(name, None)
        _families.clear()
        _loaded = False


def families() -> dict[str, DrafterMethod]:
    """name -> family, the installed entry points loaded on the first call."""
    global _loaded
    with _lock:
        if not _loaded:
            for name, found in load_group(ENTRY_POINT_GROUP, "drafter family", DrafterMethod).items():
                _families.setdefault(name, found)
            _families.update(_registered)
            _loaded = True
        return dict(_families)


def family(name: str) -> DrafterMethod | None:
    return families().get(name)
