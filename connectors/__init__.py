"""hsx connectors: where captured hidden states go, and how they are read back.

    config.py                          KVTransferConfig, the connector registry
    base.py                            HiddenStatesConnector (the interface), RequestInfo
    example_hidden_states_connector.py the safetensors connector on fsspec storage (+ vLLM-compatible load/cleanup)
    format.py                          the file format and its metadata (HiddenStatesSpec)
    paths.py                           default file names, custom-path containment
    storage.py                         fsspec primitives: atomic writes, pending-write locks, retries
    writer.py                          background writes with a bound on bytes in flight
    reader.py                          load_hidden_states / read_hidden_states_info / cleanup_hidden_states

This package never imports transformers or ray.
"""

from connectors.base import HiddenStatesConnector, RequestInfo
from connectors.config import KVTransferConfig, get_connector_class, register_connector, registered_connectors
from connectors.format import HiddenStatesFileInfo, HiddenStatesSpec
from connectors.paths import PathRejected
from connectors.reader import cleanup_hidden_states, load_hidden_states, read_hidden_states_info

__all__ = [
    "HiddenStatesConnector",
    "HiddenStatesFileInfo",
    "HiddenStatesSpec",
    "KVTransferConfig",
    "PathRejected",
    "RequestInfo",
    "cleanup_hidden_states",
    "example_hidden_states_connector",
    "get_connector_class",
    "load_hidden_states",
    "read_hidden_states_info",
    "register_connector",
    "registered_connectors",
]


def __getattr__(name: str):
    # lazy: the connector module and the torch Dataset load only when asked for
    if name == "example_hidden_states_connector":
        import importlib

        return importlib.import_module("connectors.example_hidden_states_connector")
    if name in ("HiddenStatesDataset", "HiddenStatesDatasetConfig", "ShardSampler"):
        from connectors import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module 'connectors' has no attribute {name!r}")
