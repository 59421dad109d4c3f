"""The engines a target runs on: the engine a worker holds, one description per engine kind, and one registry that
chooses a kind by name (`--engine`), filled from the `hsx.engines` entry points as the drafter families are
(extractor.methods), so nothing here names a package above it.

Engine: what a worker holds, built by its kind (extractor.LLM; vllm_engine.engine.VllmEngine)
    generate(prompts, sampling_params, request_ids) -> [RequestOutput]
                                    one per prompt, in order, once every file it reports is durable; each output's
                                    kv_transfer_params name its file (None, with error and error_kind, when it failed)
    spec                            the connectors.format.HiddenStatesSpec it writes (checked against run.json's before work)
    shutdown()                      free the model and the engine's processes now

EngineKind: one engine, described without loading it (neither torch nor the engine's own package is imported)
  where a command is configured (jobs.config, training.evaluate):
    name                            `--engine NAME`
    missing() -> str | None         one line saying how to install it where it cannot be imported, else None
    settings(flags) -> settings     its settings from the job's engine flags (EngineFlags); ValueError in one line,
                                    naming the flag, for one that does not fit it
  where a job is planned (jobs.model, jobs.pipeline, jobs.runinfo):
    checks_model                    whether hsx checks that the target is one its engine builds and packs (hsx's
                                    engine builds it with transformers); an engine of its own decides for itself
    ranks(settings) -> int | None   devices one engine spans, each taken whole (vLLM's T x P ranks); None: one
                                    device, or a share of one
    quantization(settings) -> str   what the engine does to the weights beyond the checkpoint, as run.json records
                                    it ("" for nothing)
  in an extraction worker (jobs.worker):
    build(config, connector, settings) -> Engine
                                    the engine for an extractor.EngineConfig, writing with connectors'
                                    HiddenStatesConnectorConfig; with speculative_engine() the only calls that
                                    import the engine's own package
    images                          whether image samples run on it (through the engine's prepare_media)
    files_in_process                whether its connector writes in the worker's own process (an online job's files
                                    may then stay in memory) rather than in processes of the engine's
    lock_files                      whether files written straight to a local output keep `<file>.lock` (vLLM's
                                    load_hidden_states opens it)
  in the evaluation (training.evaluate):
    speculative_engine() -> class   what `hsx eval-drafter --engine NAME` decodes with: Class(model=,
                                    speculative_config=, device=, max_num_seqs=) with generate and get_metrics

The registry:
    ENTRY_POINT_GROUP               "hsx.engines": `name = "module:KIND"` in a package's pyproject.toml; hsx's own
                                    (hsx = extractor.hsx_kind, vllm = vllm_engine.kind) in hsx's
    DEFAULT                         "hsx", the engine when none is named
    register(kind) / unregister(name)
                                    add a kind (a test's, a plug-in's not installed) / take it out again; in
                                    this process only (Ray's workers find kinds through the entry points)
    names() -> [str]                every engine's name, the default first, nothing loaded
    engine_kind(name, flag) -> EngineKind
                                    one kind, its entry point loaded when first asked for (so `--engine hsx` never
                                    imports vllm_engine); ValueError in one line listing the engines there are when
                                    `name` is none of them
    kinds() -> {name: kind}         every one, loaded (no engine is imported)
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from extractor.plugins import declared, load_entry_point

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from connectors.extra_config import HiddenStatesConnectorConfig
    from connectors.format import HiddenStatesSpec
    from extractor.config import EngineConfig
    from extractor.llm import RequestOutput
    from extractor.sampling import SamplingParams

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hsx.engines"
DEFAULT = "hsx"


@dataclass(frozen=True)
class EngineFlags:
    """The job's flags an engine kind reads for its settings (JobConfig's, one to one: `hsx run --help`)."""

    tensor_parallel_size: int = 1
    """Devices one engine spans by tensor parallelism."""
    pipeline_parallel_size: int = 1
    """Pipeline-parallel stages per engine."""
    enable_expert_parallel: bool = False
    """Spread a MoE target's experts over the engine's ranks."""
    vllm_args: dict[str, Any] = field(default_factory=dict)
    """Further vllm.LLM arguments."""
    target: str = "states"
    """What is kept of the last layer: states, or top_k:K (computed inside the engine)."""


@runtime_checkable
class Engine(Protocol):
    """See the module docstring."""

    spec: HiddenStatesSpec

    def generate(self, prompts: Sequence[Mapping[str, Any] | str], sampling_params: Sequence[SamplingParams],
                 request_ids: Sequence[str] | None = None) -> list[RequestOutput]: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class EngineKind(Protocol):
    """See the module docstring (members grouped by who reads them)."""

    name: str
    checks_model: bool
    images: bool
    files_in_process: bool
    lock_files: bool

    def missing(self) -> str | None: ...

    def settings(self, flags: EngineFlags) -> Any: ...

    def ranks(self, settings: Any) -> int | None: ...

    def quantization(self, settings: Any) -> str: ...

    def build(self, config: EngineConfig, connector: HiddenStatesConnectorConfig, settings: Any) -> Engine: ...

    def speculative_engine(self) -> type: ...


_lock = threading.Lock()
_kinds: dict[str, EngineKind] = {}
"""The kinds loaded so far, by name (an entry point is loaded when its name is first asked for)."""
_registered: dict[str, EngineKind] = {}


def register(kind: EngineKind) -> None:
    """Add `kind` (it wins over an installed one of the same name)."""
    if not isinstance(kind, EngineKind):
        raise TypeError(f"{kind!r} is not an engine kind: it needs the members of extractor.engines.EngineKind "
                        "(name, checks_model, images, files_in_process, lock_files, missing(), settings(), ranks(), "
                        "quantization(), build(), speculative_engine())")
    with _lock:
        _registered[kind.name] = kind


def unregister(name: str) -> None:
    """Remove a kind `register` added; the installed entry point of that name, if any, is found again."""
    with _lock:
        _registered.pop(name, None)


def names() -> list[str]:
    """Every engine's name, the default first (nothing is loaded)."""
    found = {ep.name for ep in declared(ENTRY_POINT_GROUP)} | set(_registered)
    return sorted(found, key=lambda n: (n != DEFAULT, n))


def kinds() -> dict[str, EngineKind]:
    """name -> kind, every one loaded (none of them imports its engine); one that fails to load is logged and
    left out."""
    out = {}
    for name in names():
        try:
            out[name] = engine_kind(name)
        except ValueError as e:
            logger.warning("%s; left out", e)
    return out


def engine_kind(name: str, flag: str = "--engine") -> EngineKind:
    """The kind called `name`, its entry point loaded on first use; ValueError in one line naming the engines there
    are (the default first) when none is called so, or saying why its entry point did not load."""
    with _lock:
        if name in _registered:
            return _registered[name]
        if name in _kinds:
            return _kinds[name]
    ep = next((ep for ep in declared(ENTRY_POINT_GROUP) if ep.name == name), None)
    if ep is None:
        choices = [f"{n} (the default)" if n == DEFAULT else n for n in names()]
        listed = " or ".join(choices) if len(choices) <= 2 else ", ".join(choices[:-1]) + " or " + choices[-1]
        raise ValueError(f"{flag} {name!r} is not an engine; use {listed or 'one installed with hsx'}")
    kind = load_entry_point(ep, "engine kind", EngineKind)
    with _lock:
        return _kinds.setdefault(name, kind)
