"""`KVTransferConfig` (vLLM's name and fields) and the connector registry.

Connectors are registered by name with a lazy "module:Class" target, so naming one never imports another's
dependencies. `SafetensorsHiddenStatesConnector` is hsx's; `ExampleHiddenStatesConnector` is the name vLLM users
already type (and `HsxHiddenStatesConnector` an older alias) for the same class.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from connectors.format import HiddenStatesSpec

_SAFETENSORS = "connectors.safetensors_connector:SafetensorsHiddenStatesConnector"
_REGISTRY: dict[str, str] = {
    "SafetensorsHiddenStatesConnector": _SAFETENSORS,
    "ExampleHiddenStatesConnector": _SAFETENSORS,  # vLLM's name
    "HsxHiddenStatesConnector": _SAFETENSORS,
    "NullConnector": "connectors.base:NullConnector",  # writes nothing: an engine that only generates
}
KV_ROLES = ("kv_producer",)


def register_connector(name: str, target: str) -> None:
    """Register a connector class under `name`; `target` is "package.module:ClassName", imported on first use."""
    if ":" not in target:
        raise ValueError(f"connector target {target!r} must look like 'package.module:ClassName'")
    _REGISTRY[name] = target


def registered_connectors() -> list[str]:
    return sorted(_REGISTRY)


def get_connector_class(name: str) -> type:
    if name not in _REGISTRY:
        raise ValueError(f"unknown kv_connector {name!r}; registered connectors: {registered_connectors()}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass
class KVTransferConfig:
    """Which connector persists hidden states, and its settings (vLLM's `KVTransferConfig` fields)."""

    kv_connector: str = "ExampleHiddenStatesConnector"
    """Registered connector name; see `registered_connectors()`."""
    kv_role: str = "kv_producer"
    """Only "kv_producer": hsx connectors write hidden states, they do not consume KV caches."""
    kv_connector_extra_config: Any = field(default_factory=dict)
    """Connector settings: a dict, e.g. {"shared_storage_path": "s3://bucket/run", "allow_custom_save_path": True},
    or the connector's own typed config (its `extra_config_class`), used as is."""

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role {self.kv_role!r} is not supported; hsx connectors only write hidden states, "
                             f"use one of {list(KV_ROLES)}")
        typed = self.connector_class.extra_config_class
        if not isinstance(self.kv_connector_extra_config, dict) and not (
                typed is not None and isinstance(self.kv_connector_extra_config, typed)):
            raise TypeError(f"kv_connector_extra_config must be a dict, got "
                            f"{type(self.kv_connector_extra_config).__name__}"
                            + (f" (or pass a {typed.__name__})" if typed else ""))
        # validates the name and the extra-config keys now, not at the first request
        self.connector_class.parse_extra_config(self.kv_connector_extra_config)

    @property
    def connector_class(self) -> type:
        return get_connector_class(self.kv_connector)

    def create_connector(self, spec: HiddenStatesSpec):
        """Build the configured connector for a producer whose files follow `spec`."""
        cls = self.connector_class
        return cls(cls.parse_extra_config(self.kv_connector_extra_config), spec)
